"""AmaxBatch in one process: deferred updates equal immediate ones, a state queued twice flushes
first; the report's distributed section from metrics records."""

from __future__ import annotations

import torch

from fp8lab.distributed.amax import AmaxBatch
from fp8lab.scaling.delayed import DelayedScaling


def _states() -> list[DelayedScaling]:
    return [DelayedScaling(history_len=4, fmt="e4m3") for _ in range(3)]


def test_deferred_updates_equal_immediate_ones() -> None:
    plain, batched = _states(), _states()
    batch = AmaxBatch()
    for ds in batched:
        ds.group = batch
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        amaxes = torch.rand(3, generator=gen) * 100
        for a, p, b in zip(amaxes, plain, batched, strict=True):
            p.observe(a)
            b.observe(a)
            p.update()
            b.update()  # deferred: the scale does not move yet
        assert batch.flush() == 3
        for p, b in zip(plain, batched, strict=True):
            assert torch.equal(p.state_dict()["amax_history"], b.state_dict()["amax_history"])
            assert torch.equal(p.scale.view(torch.int32), b.scale.view(torch.int32))
    assert batch.updates == 15 and batch.flush() == 0


def test_a_state_updated_twice_before_the_flush_updates_once() -> None:
    # TE's fp8_autocast semantics: a module run twice max-combines its amaxes, one update
    (p,), (b,) = _states()[:1], _states()[:1]
    batch = AmaxBatch()
    b.group = batch
    for a in (3.0, 7.0):
        p.observe(a)
        b.observe(a)
        b.update()
    p.update()
    assert batch.flush() == 1
    assert torch.equal(p.state_dict()["amax_history"], b.state_dict()["amax_history"])
    assert torch.equal(p.scale, b.scale) and int(p.state_dict()["step"]) == 1


def test_report_section_from_metrics() -> None:
    from fp8lab.distributed.comm import bytes_per_rank
    from fp8lab.report.comm import comm_markdown, comm_rows

    rec = {"ranks": 2, "amax_group": "none", "grad_comm": "fp8", "sharding": "ddp",
           "grad_numel": 1000, "grad_comm_bytes": 600.0, "grad_comm_rel_error": 0.05,
           "grad_comm_messages": 200, "grad_comm_underflow": 2, "grad_comm_overflow": 0,
           "scale_spread_binades": 0.5}  # fmt: skip
    metrics = {"te-delayed": [rec, {**rec, "grad_comm_rel_error": 0.07,
                                    "scale_spread_binades": 1.5}], "fp32": [{"step": 1}]}  # fmt: skip
    (row,) = comm_rows(metrics)  # single-process runs have no row
    assert row["rel_error"] == "6.00e-02" and row["spread"] == "1.5"
    assert row["underflow"] == "1" and row["overflow"] == "0"  # 4 of 400 elements
    assert row["bytes_fp8"] == f"{bytes_per_rank(1000, 2, 'fp8', 25 * 2**20 // 4) / 2**20:.3f}"
    assert "## Distributed training" in comm_markdown(metrics)
    assert comm_markdown({"fp32": [{"step": 1}]}) == ""
