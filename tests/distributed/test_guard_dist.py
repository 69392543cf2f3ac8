"""The anomaly guard under torchrun (2 gloo ranks, tests/distributed/_guard_worker.py), DDP and FSDP2:
every rank takes the same decision, an injected NaN costs one rollback on both ranks and the run
ends equal to the clean 2-rank run; an anomaly only one rank sees rolls back both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# multi-process torch.distributed (gloo) runs: make test-slow
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_guard_worker.py")
TEXT = "Now is the winter of our discontent made glorious summer by this sun. " * 40


def _run(out: Path, *args: str, timeout: float = 150.0) -> list[dict]:
    out.mkdir(parents=True)
    (out / "t.txt").write_text(TEXT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(WORKER), str(out), *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_guard_decisions_are_agreed_by_all_ranks(tmp_path: Path, mode: str) -> None:
    r0, r1 = _run(tmp_path / mode, *(["fsdp"] if mode == "fsdp" else []))
    assert r0 == r1  # the same events, losses and steps on both ranks
    clean, nan, split = r0["clean"], r0["nan"], r0["split"]
    assert clean["events"] == [] and clean["steps"] == list(range(1, 9))
    assert clean["percentages_measured"] >= 3  # each rank measured its own operands
    # the NaN step: one rollback (to the snapshot at step 3), then a replay equal to the
    # clean run: no step lost or applied twice
    assert nan["events"] == [["rollback", 4, "nonfinite", 3]]
    assert nan["steps"] == clean["steps"] and nan["losses"] == clean["losses"]
    # rank 1 alone found an anomaly on step 5: both ranks rolled back (rank 0 too, or the
    # ranks' models would have parted), and the replay is the clean run again
    assert split["events"] == [["rollback", 5, "loss_zscore", 3]]
    assert split["steps"] == clean["steps"] and split["losses"] == clean["losses"]
    # the checkpoint written right after the rollback (its loop state has the event) holds the
    # full tensors, also under FSDP, where every rank gathers its shard for rank 0 to write
    ck = torch.load(tmp_path / mode / "nan" / "checkpoints" / "step-000003.pt",
                    weights_only=True)  # fmt: skip
    assert [e["action"] for e in ck["loop"]["guard_events"]] == ["rollback"]
    assert tuple(ck["model"]["blocks.0.mlp.up.weight"].shape) == (64, 32)
