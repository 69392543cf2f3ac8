"""fp8lab.lab.compare_runs.run_order: the one definition of a comparison's runs and their order,
which rank 0 (`run_comparison`) and the other torchrun ranks (`fp8lab compare`) both train."""

from __future__ import annotations

from types import SimpleNamespace

from fp8lab.lab.compare_runs import run_order


def test_recipes_once_each_baseline_first_when_missing_then_the_replicas():
    assert run_order(["te-delayed", "fp32", "te-delayed"], "bf16", 1337, 2) == (
        ["bf16", "te-delayed", "fp32"],
        ["bf16@seed1338", "bf16@seed1339"],
    )
    # a baseline among the recipes keeps its place; no noise seeds, no replicas
    assert run_order(["fp32", "bf16"], "bf16", 7) == (["fp32", "bf16"], [])


def test_other_ranks_train_rank0s_runs_in_rank0s_order(tmp_path, monkeypatch):
    import fp8lab.distributed.runtime as runtime
    import fp8lab.lab.compare_runs as compare_runs
    import fp8lab.lab.data as data
    from fp8lab.cli.compare import _follow_rank0

    trained = []
    monkeypatch.setattr(
        compare_runs, "run_recipes", lambda cfg, names, *a, **k: trained.append(names)
    )
    monkeypatch.setattr(data, "load_corpus", lambda *a: None)
    monkeypatch.setattr(runtime, "leave_group", lambda: None)
    (tmp_path / "config.json").write_text("{}")  # rank 0 prepared the output directory
    cfg = SimpleNamespace(train=SimpleNamespace(seed=5), data=None,
                          model=SimpleNamespace(block_size=16))  # fmt: skip
    _follow_rank0(cfg, ["mxfp8", "fp32", "mxfp8"], "bf16", tmp_path, 1, noise_seeds=1)
    recipes, replicas = run_order(["mxfp8", "fp32", "mxfp8"], "bf16", 5, 1)
    assert trained == [[*recipes, *replicas]] == [["bf16", "mxfp8", "fp32", "bf16@seed6"]]
