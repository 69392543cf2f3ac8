"""scripts/gpu_check.py on the CPU: ``--smoke`` runs every section at tiny sizes (the device side
is the device-generic torch kernels, the reference numba) and writes the JSON a GPU machine
writes; its comparisons, time-box and argument checks are tested directly."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

import gpu_check_module
from gpu_check_module import SCRIPT

gc = gpu_check_module.load()
CPU = torch.device("cpu")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900
    )


# ------------------------------------------------------------------------ the smoke run
@pytest.mark.slow
def test_smoke_writes_every_section_with_zero_mismatches(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = _run("--smoke", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("bit_identity", "scaled_mm", "step_time", "cast_time", "distributed", "device",
                "triton_fused"):  # fmt: skip
        assert key in report
    assert {"torch", "date", "fp8lab", "failures"} <= set(report)
    assert report["fp8lab"]["version"]
    bits = report["bit_identity"]["summary"]
    assert bits["exact_cases"] > 300 and bits["bounded_cases"] >= 5
    # a NaN's sign and payload are not part of fp8lab's arithmetic (the kernels' convention: CUDA
    # canonicalises NaN); every other bit is, and encode's FP8 codes are compared as integers
    assert bits["exact_mismatches"] == bits["nan_bits_only"]
    assert bits["bound_violations"] == 0
    assert bits["errors"] == 0 and bits["skipped"] == 0
    for group in ("cast", "quantize", "qmatmul"):
        assert report["bit_identity"][group]["summary"]["exact_cases"] > 0
    assert report["scaled_mm"] == {"skipped": "needs CUDA"}
    dist = report["distributed"]  # one torchrun rank: gloo on the CPU (NCCL on a GPU)
    assert (dist["backend"], dist["world"]) == ("gloo", 1)
    for name in ("ddp", "fsdp", "fsdp-fp8-allgather"):
        assert dist["cases"][name]["finite"], dist["cases"][name]
    steps = report["step_time"]["cases"]
    assert set(steps) == set(gc.STEP_CASES)
    for case, rec in steps.items():
        assert "error" not in rec, (case, rec)
    assert steps["native-fp32"]["median_ms"] > 0 and steps["native-bf16"]["median_ms"] > 0
    ratios = report["step_time"]["ratios"]
    assert ratios["native-fp32"]["vs_native_fp32"] == 1.0
    assert report["failures"] == []


def test_smoke_sections_subset_and_budget(tmp_path):
    """Only the sections asked for run; with no time left, bit identity records what it did not
    run as skipped instead of running over the budget."""
    out = tmp_path / "r.json"
    assert (
        gc.main(["--smoke", "--sections", "bit_identity", "--budget-s", "1e-9", "--out", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["step_time"] == {"skipped": "not requested"}
    bits = report["bit_identity"]
    assert bits["summary"]["skipped"] == 3 and bits["summary"]["exact_cases"] == 0
    assert bits["cast"]["cases"][0]["case"].startswith("cast from cast fp32 nearest_even")
    md = gc.markdown(report)  # the README's tables from the report
    assert "| cast | 0 | 0 | 0 | 0 | 0 |" in md and "on CPU" in md
    assert "| step |" not in md  # not run: no step table


def test_markdown_step_table_and_bad_report(tmp_path, capsys):
    report = json.loads(json.dumps(_fake_report()))
    md = gc.markdown(report)
    assert "on NVIDIA H100 80GB HBM3, torch 2.11.0 (CUDA 13.0)" in md
    assert "| te-current | 120.0 | 2.4 | 1.2 |" in md
    assert "| deepseek-v3-h100 | time | None | None |" in md
    assert "fits promotion every 128 (0 differ)" in md
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert gc.main(["--markdown", str(bad)]) == 2
    assert "not a gpu_check report" in capsys.readouterr().err


def _fake_report() -> dict:
    cases = {
        "native-fp32": {"median_ms": 100.0},
        "native-bf16": {"median_ms": 50.0},
        "te-current": {"median_ms": 120.0},
        "deepseek-v3-h100": {"skipped": "time"},
    }
    mm = {"fast_accum_mismatches": 0, "elements": 10, "best_interval": "128"}
    mm["slow_accum_mismatches_by_interval"] = {"never": 9, "128": 0}
    return {
        "device": {"name": "NVIDIA H100 80GB HBM3"},
        "torch": {"version": "2.11.0", "cuda": "13.0"},
        "fp8lab": {"commit": "abc", "version": "0.1.0"},
        "date": "2026-11-28",
        "bit_identity": {},
        "scaled_mm": mm,
        "step_time": {"cases": cases, "ratios": gc.step_ratios(cases)},
    }


# --------------------------------------------------------------------- bad arguments
def test_existing_out_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "mine.json"
    out.write_text("mine")
    with pytest.raises(SystemExit) as exc:
        gc.main(["--smoke", "--out", str(out)])
    assert exc.value.code == 2
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == "mine"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--smoke"], "--out PATH is required"),
        (["--smoke", "--sections", "bits"], "--sections: unknown bits"),
        (["--smoke", "--budget-s", "-1"], "--budget-s must be > 0"),
        (["--smoke", "--device", "nonsense"], "--device 'nonsense'"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, capsys, args, message):
    if "--out" not in message:
        args = [*args, "--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as exc:
        gc.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_exits_2(tmp_path):
    res = _run("--out", str(tmp_path / "x.json"))
    assert res.returncode == 2
    assert "sees no CUDA device" in res.stderr


# ------------------------------------------------------------------- the comparisons
def test_bit_mismatches_counts_bits_not_values():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    b = torch.tensor([-0.0, 1.0, float("nan"), 2.0])
    b[2] = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # another NaN payload
    assert gc.bit_mismatches(a, a.clone()) == {"elements": 4, "mismatches": 0}
    assert gc.bit_mismatches(a, b) == {"elements": 4, "mismatches": 2, "nan_bits_only": 1}


def test_bit_mismatches_of_qtensors_and_shape_changes():
    import fp8lab

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q = fp8lab.quantize(x, "e4m3", (1, 128), "max")
    same = gc.bit_mismatches(q, gc.to_device(q, CPU))
    assert same["mismatches"] == 0 and same["elements"] == 64 * 256 + 2 * (
        64 * 2
    )  # values, scales, multipliers
    r = gc.bit_mismatches(torch.zeros(4), torch.zeros(2, 2))
    assert r["mismatches"] == 4 and "note" in r


def test_fp32_gemm_bound_holds_for_other_orders_and_catches_larger_errors():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 4096, generator=g), torch.randn(4096, 16, generator=g)
    exact = (a.double() @ b.double()).float()  # another summation order, rounded once
    blas = a @ b
    bound = gc.fp32_gemm_bound(a, b)
    ok = gc.bounded_mismatches(exact, blas, bound)
    assert ok["bound_violations"] == 0 and ok["max_ulp"] >= 1  # orders differ, within the bound
    worse = blas.clone()
    worse[3, 5] += 2 * float(bound[3, 5])
    bad = gc.bounded_mismatches(exact, worse, bound)
    assert bad["bound_violations"] == 1
    inf = blas.clone()
    inf[0, 0] = float("inf")
    assert gc.bounded_mismatches(inf, blas, bound)["bound_violations"] == 1
    nan, other_nan = blas.clone(), blas.clone()
    nan[1, 1], other_nan[1, 1] = float("nan"), -float("nan")  # another NaN pattern: no violation
    assert gc.bounded_mismatches(nan, other_nan, bound)["bound_violations"] == 0
    assert gc.bounded_mismatches(nan, blas, bound)["bound_violations"] == 1


def test_run_case_reports_what_differs():
    from fp8lab.kernels import get_kernels

    def differs(d):  # one ulp off whenever the torch kernels are chosen
        x = torch.ones(8, device=d)
        if get_kernels() == "torch":
            x[3] = torch.nextafter(x[3], torch.tensor(2.0))
        return x

    rec = gc.run_case(gc.Case("differs", differs), CPU)
    assert rec["mismatches"] == 1 and rec["elements"] == 8

    def refuse(d):
        raise ValueError("no such format")

    assert gc.run_case(gc.Case("refuse", refuse), CPU)["refused"].startswith("ValueError")

    def only_torch_fails(d):
        if get_kernels() == "torch":
            raise NotImplementedError("not ported")
        return torch.zeros(1)

    rec = gc.run_case(gc.Case("port", only_torch_fails), CPU)
    assert "NotImplementedError: not ported" in rec["error"] and "test_gpu_check.py" in rec["error"]


def test_summarize_and_failures():
    records = [
        {"case": "a", "torch_dispatches": 1, "elements": 4, "mismatches": 1},
        {"case": "b", "torch_dispatches": 0, "elements": 4, "mismatches": 0},
        {"case": "c", "torch_dispatches": 1, "bound_violations": 0, "max_ulp": 3, "elements": 2},
        {"case": "d", "error": "cuda: boom"},
    ]
    s = gc.summarize(records)
    assert (s["exact_mismatches"], s["errors"], s["max_ulp_fp32_gemm"]) == (1, 1, 3)
    assert s["not_dispatched_to_torch"] == 1 and s["not_dispatched_examples"] == ["b"]
    fails = gc.failures(
        {"bit_identity": {"summary": s}, "step_time": {"cases": {"x": {"error": "e"}}}}
    )
    assert fails == [
        "bit_identity: exact_mismatches = 1 (NaN sign/payload aside)",
        "bit_identity: errors = 1",
        "step_time: errors in x",
    ]
    nan_only = {**s, "exact_mismatches": 3, "nan_bits_only": 3, "errors": 0}
    assert gc.failures({"bit_identity": {"summary": nan_only}}) == []
    assert gc.warnings({"bit_identity": {"summary": nan_only}}) == [
        "bit_identity: 3 elements differ only in NaN sign/payload"
    ]


def test_step_ratios():
    r = gc.step_ratios({
        "native-fp32": {"median_ms": 100.0},
        "native-bf16": {"median_ms": 50.0},
        "te-current": {"median_ms": 120.0},
        "deepseek-v3-h100": {"skipped": "time"},
    })  # fmt: skip
    assert r["te-current"] == {
        "vs_native_bf16": 2.4,
        "vs_native_fp32": 1.2,
        "target_vs_native_fp32": 1.3,
        "meets_target": True,
    }
    assert r["deepseek-v3-h100"]["vs_native_fp32"] is None
    assert r["deepseek-v3-h100"]["meets_target"] is None


def test_cases_cover_every_format_rounding_rule_and_accumulator():
    import fp8lab

    cast_names = {c.name for c in gc.cast_cases(gc.SMOKE)}
    for fmt in fp8lab.format_names():
        for rounding in fp8lab.ROUNDING_MODES:
            assert f"cast {fmt} {rounding} sat=True f32" in cast_names
    specs = gc.quant_specs()
    rules = {s.scaling if isinstance(s.scaling, str) else "delayed" for s in specs}
    assert {"max", "pow2_down", "pow2_up", "mx_floor", "mx_ceil", "mx_even", "mx_rceil"} <= rules
    assert {"nvfp4", "delayed"} <= rules
    blocks = {str(s.granularity) for s in specs}
    assert {"tensor", "(1, 128)", "(128, 128)", "(128, 1)", "mx", "nvfp4"} <= blocks
    mm = " ".join(c.name for c in gc.qmatmul_cases(gc.SMOKE))
    for acc in ("fp32", "limited(m=13)", "h100", "h200", "ada", "b200", "h100(promote=128)"):
        assert f"acc={acc}" in mm


def test_cast_inputs_hold_ties_and_specials():
    x = gc.cast_inputs("e4m3", gc.SMOKE)
    assert torch.isnan(x).any() and torch.isinf(x).any()
    assert (x == 448.0).any() and (x == -(2.0**-9)).any()  # e4m3 max, min subnormal
    assert (x == 464.0).any()  # the tie between 448 and the next step above max


# ------------------------------------------------------------------- the time-box
def test_a_worker_over_its_budget_is_killed_and_the_case_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(gc, "GRACE_S", 0.2)
    start = json.dumps({"event": "start", "case": "slow", "budget_s": 0.3})
    code = f"import time; print({gc._WORKER_TAG + start!r}, flush=True); time.sleep(60)"
    with (tmp_path / "err.log").open("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        results, pending = {}, ["slow", "next"]
        t0 = time.time()
        gc.drive(proc, gc.reader(proc), results, pending, time.time() + 60, err)
    assert time.time() - t0 < 30
    assert proc.returncode is not None  # killed
    assert results == {"slow": {"skipped": "time", "note": "killed after its budget"}}
    assert pending == ["next"]


def test_a_crashed_worker_is_an_error_naming_its_output(tmp_path):
    start = json.dumps({"event": "start", "case": "boom", "budget_s": 30})
    code = (
        f"import sys; print({gc._WORKER_TAG + start!r}, flush=True); "
        "sys.stderr.write('CUDA error: out of memory'); sys.exit(3)"
    )
    with (tmp_path / "err.log").open("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True
        )
        results, pending = {}, ["boom"]
        gc.drive(proc, gc.reader(proc), results, pending, time.time() + 60, err)
    assert results["boom"]["error"].startswith("worker exited 3")
    assert "out of memory" in results["boom"]["error"]
    assert pending == []


# ------------------------------------------------------------------- scaled_mm's code
def test_scaled_mm_case_record_on_the_cpu():
    """The scaled_mm case's code on torch's CPU _scaled_mm (an FP32-exact GEMM there, not a
    tensor core: the counts are not the GPU's, only the record's shape is checked)."""
    try:
        rec = gc.scaled_mm_case("e4m3", "e5m2", 64, False, 32, CPU)
    except (RuntimeError, NotImplementedError) as exc:  # a torch without the CPU kernel
        pytest.skip(f"torch._scaled_mm on the CPU: {exc}")
    assert (rec["a"], rec["b"], rec["k"], rec["scales"], rec["elements"]) == (
        "e4m3", "e5m2", 64, "current", 32 * 32,
    )  # fmt: skip
    fits = rec["slow_accum_mismatches_by_interval"]
    assert list(fits) == ["never", *map(str, gc.PROMOTION_INTERVALS)]
    assert rec["best_interval"] in fits and 0 <= rec["fast_accum_mismatches"] <= 32 * 32


# ------------------------------------------------- what a cut-off or failing run keeps
_HANG = """
import sys, time
sys.path.insert(0, {tests!r})
import gpu_check_module
gc = gpu_check_module.load()
gc.HARD_GRACE_S = 0.5
# the section's own deadline far away: only the watchdog (budget + grace) can end the hang
gc.SECTION_ENDS = {{**gc.SECTION_ENDS, "bit_identity": 100.0}}
real, calls = gc.run_case, []

def run_case(case, device):  # the third case hangs (a compile or a kernel that never ends)
    calls.append(case.name)
    if len(calls) == 3:
        time.sleep(120)
    return real(case, device)

gc.run_case = run_case
sys.exit(gc.main(sys.argv[1:]))
"""


@pytest.mark.slow  # runs gpu_check with a hung section until its watchdog fires: make test-slow
def test_watchdog_writes_what_a_hung_section_did_and_exits_1(tmp_path):
    """A section still running past the budget + HARD_GRACE_S: the report on disk holds what
    was done before it and the cases it finished, marks it interrupted, and the run exits 1."""
    out = tmp_path / "r.json"
    code = _HANG.format(tests=str(SCRIPT.parents[1] / "tests"))
    args = ["--smoke", "--sections", "scaled_mm,bit_identity", "--budget-s", "10"]
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, "-c", code, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.time() - t0 < 100  # not the 120 s the hung case sleeps
    assert res.returncode == 1, res.stderr[-2000:]
    assert "watchdog: bit_identity overran" in res.stderr
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["running"] == "bit_identity"
    assert report["device"]["torch_device"] == "cpu" and "scaled_mm" not in report  # not reached
    bits = report["bit_identity"]
    assert "interrupted" in bits
    assert [r["mismatches"] for r in bits["cast"]["cases"]] == [0, 0]  # the two that finished
    assert bits["summary"]["exact_cases"] == 2
    assert report["failures"] == ["watchdog: bit_identity still running at the hard deadline"]
    assert not (tmp_path / "r.json.tmp").exists()


def test_a_failing_section_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    """An exception out of a section (e.g. an API a torch version lacks) is that section's
    ``error``; the sections after it still run, the report is complete, the exit code 1."""

    def boom(*_args):
        raise AttributeError("module 'torch' has no attribute 'something_new'")

    monkeypatch.setattr(gc, "scaled_mm", boom)
    out = tmp_path / "r.json"
    assert gc.main(["--smoke", "--sections", "scaled_mm,cast_time", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["scaled_mm"]["error"].startswith("AttributeError: module 'torch'")
    assert report["cast_time"]["cast_nearest_even_ms"] > 0
    assert report["complete"] is True and "running" not in report
    assert report["failures"] == ["scaled_mm: error"]


def test_out_with_markdown_writes_both_and_refuses_an_existing_markdown(tmp_path, capsys):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert (
        gc.main(["--smoke", "--sections", "scaled_mm", "--out", str(out), "--markdown", str(md)])
        == 0
    )
    assert md.read_text() == gc.markdown(json.loads(out.read_text()))
    assert md.read_text().startswith("`python scripts/gpu_check.py` on CPU")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        gc.main(["--smoke", "--out", str(tmp_path / "new.json"), "--markdown", str(md)])
    assert exc.value.code == 2
    assert f"--markdown {md}: the file exists" in capsys.readouterr().err
    assert not (tmp_path / "new.json").exists()
