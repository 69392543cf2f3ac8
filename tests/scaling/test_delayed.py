"""DelayedScaling against TE's formulas, re-implemented here independently in plain numpy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import fp8lab
from fp8lab import DelayedScaling

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E4M3_MAX = 448.0

# a scripted amax sequence with a spike, a zero and a NaN
SEQ = [1.0, 2.0, 1.5, 1000.0, 3.0, 0.0, 2.5, math.nan, 0.75, 4.0, 1e-45, 0.5, 2.0]


def te_fused_reference(seq, L, algo, margin=0, fmt_max=E4M3_MAX, staged=True):
    """TE delayed_scaling.cu kernel_bulk, step by step. Returns the scale used at each step.

    ``staged``: the amax reaches the staging slot as is (a reduced amax); otherwise through
    atomicMaxFloat, which drops NaN (the slot stays 0).
    """
    hist = [F32(0)] * L  # hist[0] staging, hist[1:] oldest..newest
    scale = F32(1.0)
    scaled_max = F32(fmt_max * 2.0**-margin)
    used = []
    for a in seq:
        used.append(scale)
        a = F32(a)
        if not staged and np.isnan(a):
            a = F32(0)
        hist[0] = a
        last = hist[0]
        amax = F32(0)
        if last != 0:
            window = [*hist[1:], last]
            for v in window:  # fmaxf: NaN ignored
                if not np.isnan(v):
                    amax = max(amax, v)
            hist = [F32(0), *window[1:]]
        if algo == "most_recent":
            amax = last
        if np.isfinite(amax) and amax > 0:
            with np.errstate(over="ignore"):
                scale = F32(scaled_max / amax)
        if np.isinf(scale):
            scale = FLT_MAX
    return used


def te_python_reference(seq, L, algo, margin=0, fmt_max=E4M3_MAX):
    """TE quantization.py _amax_and_scale_update (unfused): always rolls, torch.max with NaN."""
    hist = [F32(0)] * L
    scale = F32(1.0)
    used = []
    for a in seq:
        used.append(scale)
        hist[0] = F32(a)
        if callable(algo):
            amax = F32(algo(hist))
        elif algo == "max":
            amax = F32(np.nan) if any(np.isnan(v) for v in hist) else max(hist)
        else:
            amax = hist[0]
        hist = [*hist[1:], hist[0]]
        hist[0] = F32(0)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            # TE's `fp8_max / amax` with a Python float numerator: Tensor.__rdiv__ in eager
            # PyTorch, amax.reciprocal() * fp8_max (two float32 roundings)
            sf = F32(F32(F32(1) / amax) * F32(fmt_max)) / F32(2.0**margin)
        if np.isfinite(amax) and amax > 0:
            scale = F32(sf)
        if np.isinf(scale):
            scale = FLT_MAX
    return used


def run(ds, seq, staged=True):
    used = []
    for a in seq:
        used.append(F32(ds.scale_for().item()))
        if staged:
            ds.stage(a)
        else:
            ds.observe(a)
        ds.update("e4m3")
    return used


@pytest.mark.parametrize("L", [1, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fused_path_matches_te_formulas(L, algo):
    got = run(DelayedScaling(history_len=L, algorithm=algo), SEQ)
    want = te_fused_reference(SEQ, L, algo)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    # the spike dominates the window afterwards with "max" only if the window holds it
    spike_step = SEQ.index(1000.0) + 1
    expect_spike = F32(F32(448.0) / F32(1000.0))
    if algo == "max" and L >= 16:
        assert got[spike_step + 1] == expect_spike  # still in the window
    if algo == "most_recent" or L == 1:
        assert got[spike_step + 1] == F32(F32(448.0) / F32(3.0))


def test_zero_and_nan_keep_scale_and_zero_does_not_roll():
    ds = DelayedScaling(history_len=4)
    for a in (2.0, 0.0):
        ds.observe(a)
        ds.update("e4m3")
    assert ds.scale.item() == 224.0
    # the zero step did not roll: the history holds only the 2.0 at the newest position
    assert ds.amax_history.tolist() == [0.0, 0.0, 0.0, 2.0]
    # a NaN through observe() is dropped like atomicMaxFloat drops it: no roll either
    ds.observe(math.nan)
    ds.update()
    assert ds.amax_history.tolist() == [0.0, 0.0, 0.0, 2.0] and ds.scale.item() == 224.0
    # a NaN that reaches the staging slot (a reduced amax) rolls, but fmaxf ignores it
    ds.stage(math.nan)
    ds.update()
    h = ds.amax_history.tolist()
    assert math.isnan(h[3]) and h[2] == 2.0 and ds.scale.item() == 224.0


@pytest.mark.parametrize("L", [1, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_observe_path_matches_te(L, algo):
    got = run(DelayedScaling(history_len=L, algorithm=algo), SEQ, staged=False)
    want = te_fused_reference(SEQ, L, algo, staged=False)
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("L", [1, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_python_path_matches_te_unfused(L, algo):
    got = run(DelayedScaling(history_len=L, algorithm=algo, update_path="python"), SEQ)
    want = te_python_reference(SEQ, L, algo)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_python_path_is_te_eager_reciprocal_times_max():
    # issue example: amax 3.0, L = 1, e4m3: TE's unfused path gives 0x43155556 (the correctly
    # rounded quotient 448/3 is 0x43155555, which the fused path keeps)
    ds = DelayedScaling(history_len=1, update_path="python", fmt="e4m3")
    ds.observe(3.0)
    ds.update()
    assert ds.scale.view(torch.int32).item() == 0x43155556
    fused = DelayedScaling(history_len=1, fmt="e4m3")
    fused.observe(3.0)
    fused.update()
    assert fused.scale.view(torch.int32).item() == 0x43155555


@pytest.mark.parametrize(("fmt", "fmax", "margin", "nguard"),
                         [("e4m3", 448.0, 0, 0), ("e5m2", 57344.0, 1, 2), ("e4m3", 448.0, 0, 8)])  # fmt: skip
def test_python_path_equals_torch_eager_over_many_amaxes(fmt, fmax, margin, nguard):
    # TE _default_sf_compute evaluated by eager torch itself: (fp8_max / amax) / 2**margin,
    # with the Python float numerator (the path's total margin is margin + nguard)
    rng = np.random.default_rng(5)
    amaxes = np.concatenate([
        rng.random(300, dtype=np.float32) * F32(100) + F32(1e-3),
        np.exp2(rng.uniform(-120, 120, 300)).astype(np.float32),
        np.array([3.0, 7.0, 1e-38, 1e-45, 448.0, 6.0], dtype=np.float32),
    ])  # fmt: skip
    differ = 0
    for a in amaxes:
        ds = DelayedScaling(history_len=1, update_path="python", margin=margin, nguard=nguard)
        ds.stage(float(a))
        ds.update(fmt)
        t = torch.tensor(float(a), dtype=torch.float32)
        want = (fmax / t) / (2 ** (margin + nguard))
        want = torch.where(torch.isinf(want), torch.tensor(float(FLT_MAX)), want)
        assert ds.scale.view(torch.int32).item() == want.view(torch.int32).item(), a
        with np.errstate(over="ignore"):
            differ += int(want.item() != F32(F32(fmax) / a) / F32(2.0 ** (margin + nguard)))
    assert differ > 50  # the two roundings differ from one division on many amaxes


def test_fused_and_python_paths_differ_on_nan_in_window():
    seq = [2.0, math.nan, 4.0, 1.0]
    fused = run(DelayedScaling(history_len=16), seq)
    python = run(DelayedScaling(history_len=16, update_path="python"), seq)
    # after the NaN: fused ignores it (max(2, 4) = 4 -> 112), Python's torch.max is NaN -> keeps
    assert fused[3] == 112.0
    assert python[3] == 224.0


def test_fused_and_python_paths_differ_on_zero_amax():
    # a step where the tensor was not used (amax 0): the fused kernel does not roll, so the 2.0
    # stays in a window of L=2; the Python path rolls the zero in and forgets the 2.0
    seq = [2.0, 0.0, 1.0, 1.0]
    fused = run(DelayedScaling(history_len=2), seq)
    python = run(DelayedScaling(history_len=2, update_path="python"), seq)
    assert fused[3] == 224.0
    assert python[3] == 448.0


def test_callable_algorithm_takes_python_path():
    def mean_nonzero(h):
        h = torch.as_tensor(np.asarray(h, dtype=np.float32))
        nz = h[h > 0]
        return nz.mean() if nz.numel() else torch.tensor(0.0)

    seq = [1.0, 3.0, 2.0]
    got = run(DelayedScaling(history_len=8, algorithm=mean_nonzero), seq)
    want = te_python_reference(seq, 8, lambda h: mean_nonzero(h).item())
    np.testing.assert_array_equal(np.array(got), np.array(want))
    with pytest.raises(ValueError, match="callable"):
        DelayedScaling(algorithm=mean_nonzero).config()


def test_margin_and_nguard_are_powers_of_two():
    ds = DelayedScaling(margin=1, nguard=2)
    ds.observe(1.0)
    ds.update("e4m3")
    assert ds.scale.item() == 448.0 / 8
    want = te_fused_reference([1.0, 2.0], 1024, "max", margin=3)
    assert run(DelayedScaling(margin=1, nguard=2), [1.0, 2.0]) == want


def test_tiny_amax_gives_flt_max():
    ds = DelayedScaling()
    ds.observe(1e-45)
    ds.update("e4m3")
    assert ds.scale.item() == float(FLT_MAX)


def test_interval_measures_every_n_steps():
    ds = DelayedScaling(interval=3, history_len=8)
    x_amax = [1.0, 8.0, 8.0, 2.0, 16.0, 16.0, 4.0]
    used = []
    for a in x_amax:
        q = fp8lab.quantize(torch.tensor([a, -a / 2]), fp8lab.QuantSpec("e4m3", scaling=ds))
        used.append(q.scales.item())
        ds.update()
    # steps 0, 3, 6 measured; the scale changes only after them
    want = [1.0, 448.0, 448.0, 448.0, 224.0, 224.0, 224.0]
    assert used == [float(F32(1) / F32(w)) for w in want]
    assert ds.amax_history[-3:].tolist() == [1.0, 2.0, 4.0]  # the 8s and 16s never recorded


def test_first_step_current_vs_unit():
    x = torch.tensor([3.0, -1.0])
    for first, expect in (("unit", 1.0), ("current", float(F32(448) / F32(3)))):
        ds = DelayedScaling(first_step=first)
        q = fp8lab.quantize(x, "e4m3", scaling=ds)
        assert q.scales.item() == float(F32(1) / F32(expect))
        ds.update()
        # step 1 uses the delayed scale from step 0's amax in both cases
        q1 = fp8lab.quantize(x * 2, "e4m3", scaling=ds)
        assert q1.scales.item() == float(F32(1) / (F32(448) / F32(3)))
    # step 0 with unit scale saturates values above 448 and keeps 1.0 as scale
    ds = DelayedScaling()
    q = fp8lab.quantize(torch.tensor([1000.0]), "e4m3", scaling=ds)
    assert q.values.item() == 448.0


def test_state_dict_round_trip_and_resume(tmp_path):
    a = DelayedScaling(history_len=16)
    seq = [1.0, 5.0, 2.0, 0.0, 3.0]
    run(a, seq[:3])
    sd = a.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    torch.save(sd, tmp_path / "s.pt")
    b = DelayedScaling(history_len=16)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert run(a, seq[3:]) == run(b, seq[3:])
    with pytest.raises(ValueError, match="length"):
        DelayedScaling(history_len=8).load_state_dict(sd)
    with pytest.raises(KeyError):
        DelayedScaling(history_len=16).load_state_dict({"scale": torch.ones(())})


def test_config_round_trip_and_bad_args():
    ds = DelayedScaling(history_len=16, algorithm="most_recent", margin=1, interval=5,
                        first_step="current", nguard=8)  # fmt: skip
    cfg = json.loads(json.dumps(ds.config()))
    assert DelayedScaling.from_config(cfg).config() == ds.config()
    spec = fp8lab.QuantSpec("hif8", scaling=ds)
    back = fp8lab.QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    # plain data comes back as frozen configuration (no state); binding makes new state
    assert back.scaling.to_dict() == ds.config() and back.scaling == ds.cfg
    assert back.scaling is not ds
    assert DelayedScaling.bind(spec.scaling) is not ds
    for kw in ({"history_len": 0}, {"algorithm": "mean"}, {"interval": 0},
               {"first_step": "zero"}, {"update_path": "cuda"}):  # fmt: skip
        with pytest.raises(ValueError):
            DelayedScaling(**kw)
    with pytest.raises(ValueError, match="format"):
        DelayedScaling().update()
    with pytest.raises(ValueError, match="per-tensor"):
        fp8lab.QuantSpec("e4m3", "row", scaling=DelayedScaling())


def test_quantize_records_amax_ignoring_nan():
    ds = DelayedScaling(history_len=4)
    spec = fp8lab.QuantSpec("e4m3", scaling=ds)
    fp8lab.quantize(torch.tensor([1.0, math.nan, -3.0]), spec)
    fp8lab.quantize(torch.tensor([2.0]), spec)  # atomic max into the same staging slot
    assert ds.amax_history[0].item() == 3.0
    ds.update()
    assert ds.scale.item() == float(F32(448) / F32(3))


def _dist_worker(rank, world, path, out):  # pragma: no cover - runs in a subprocess
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from fp8lab.distributed import set_amax_reduction

    set_amax_reduction()  # explicit: no import turns it on
    ds = DelayedScaling(history_len=4, fmt="e4m3")
    ds.observe([2.0, 7.0][rank])
    ds.update()
    torch.save(ds.state_dict(), f"{out}.{rank}")
    dist.destroy_process_group()


# the amaxes' all-reduce across 2 processes; its arithmetic (448 / max(2, 7) = 64, exact) runs
# through no fp8lab kernel (scaling/delayed.py has none) and no instruction-set choice
@pytest.mark.no_arithmetic
@pytest.mark.slow  # two processes: make test-slow
def test_distributed_max_reduction(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_dist_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "sd")), nprocs=2)
    s0 = torch.load(f"{tmp_path / 'sd'}.0", weights_only=True)
    s1 = torch.load(f"{tmp_path / 'sd'}.1", weights_only=True)
    assert s0["scale"].item() == s1["scale"].item() == 64.0  # 448 / max(2, 7)
    assert s0["amax_history"].tolist() == [0.0, 0.0, 0.0, 7.0]


@pytest.mark.no_arithmetic  # which modules an import loads: the same on every kernel and CPU
def test_no_import_installs_the_amax_reduction():
    """The amax all-reduce is explicit (`fp8lab.distributed.set_amax_reduction`): neither the
    public API nor `fp8lab.distributed` itself installs it on import (the scaling layer never
    communicates; the distributed test above turns it on)."""
    import subprocess
    import sys

    code = (
        "import sys, fp8lab; fp8lab.FloatFormat; fp8lab.DelayedScaling; fp8lab.nn.Linear; "
        "import fp8lab.distributed.amax; "
        "from fp8lab.scaling.delayed import amax_reduction_installed as on; assert not on(); "
        "import fp8lab.distributed as d; assert d.set_amax_reduction() is False and on(); "
        "assert d.set_amax_reduction(False) is True and not on()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_is_frozen_hashable_plain_data_and_state_is_apart():
    import dataclasses

    from fp8lab.scaling.delayed import DelayedScalingConfig, delayed_scale

    cfg = DelayedScalingConfig(history_len=16, algorithm="most_recent", nguard=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.margin = 3
    assert hash(cfg) == hash(DelayedScalingConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))))
    assert DelayedScalingConfig.from_dict(cfg.to_dict()) == cfg and "group" not in cfg.to_dict()
    with pytest.raises(ValueError, match=r"unknown DelayedScaling keys.*'histroy'"):
        DelayedScalingConfig.from_dict({"histroy": 3})
    for bad in ({"history_len": "16"}, {"nguard": True}, {"reduce_amax": "yes"}):
        with pytest.raises(TypeError):
            DelayedScalingConfig(**bad)
    # contract C1: bind makes a zero state from a config or from a DelayedScaling (its state is
    # not copied; its runtime process group is, unless another is given)
    a = DelayedScaling.bind(cfg, "e4m3")
    assert a.cfg is cfg and a.step == 0 and a.state.fmt_max.item() == 448.0
    a.observe(2.0)
    a.update()
    a.group = "pg"  # runtime state, never configuration
    b = DelayedScaling.bind(a, "e5m2")
    assert b.cfg is cfg and b.step == 0 and b.scale.item() == 1.0 and b.group == "pg"
    assert a.step == 1 and a.scale.item() == 448.0 / 8  # 448 * 2**-2 / 2
    assert DelayedScaling.bind(a, group="other").group == "other"
    with pytest.raises(TypeError, match="DelayedScalingConfig"):
        DelayedScaling.bind({"history_len": 4})
    # state_dict keys and values as before: plain tensors
    assert list(a.state_dict()) == ["scale", "amax_history", "step", "initialized", "fmt_max"]
    # a config alone: step 0 from a throwaway state, nothing recorded anywhere
    assert delayed_scale(cfg, torch.tensor(1000.0), "e4m3").item() == 1.0
    cur = cfg.replace(first_step="current")
    assert delayed_scale(cur, torch.tensor(4.0), "e4m3").item() == 448.0 / 4 / 4


def test_fresh_is_a_deprecated_alias_of_bind():
    """The old public name stays: a new zero state with the same configuration and group."""
    ds = fp8lab.DelayedScaling(history_len=4, margin=1, fmt="e4m3")
    ds.observe(3.0)
    ds.update()
    with pytest.warns(DeprecationWarning, match="bind"):
        new = ds.fresh()
    assert new is not ds and new.config() == ds.config() and new.group is ds.group
    assert new.step == 0 and float(new.scale) == 1.0 and float(new.amax_history.abs().sum()) == 0
    spec = fp8lab.QuantSpec(format="e4m3", scaling=ds)
    with pytest.warns(DeprecationWarning, match="configuration"):
        fresh_spec = spec.fresh()
    assert fresh_spec.scaling is not ds and fresh_spec.scaling.step == 0
    assert fresh_spec.scaling.config() == ds.config()
    cfg_spec = fp8lab.get_recipe("te-delayed").input
    with pytest.warns(DeprecationWarning):
        assert cfg_spec.fresh() is cfg_spec
