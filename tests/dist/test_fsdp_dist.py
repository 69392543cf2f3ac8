"""FP8 all-gather of row shards (uint8 codes + scales) and the --grad-comm DDP hook on 2 gloo
processes; refusals."""

from __future__ import annotations

import pytest
import torch
from _dist_launch import run_ranks

from fp8lab.dist.fsdp import check_shardable, shard_rows
from fp8lab.qtensor import QuantSpec


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("fsdp"), 2, "fsdp")


def test_gathered_weight_equals_unsharded_quantization(ranks: list[dict]) -> None:
    for res in ranks:
        for preset in ("te-current", "deepseek-v3", "mxfp8"):
            layers = {
                k: v for k, v in res.items() if k.startswith(f"{preset}:") and "count" not in k
            }
            assert len(layers) == int(res[f"{preset}:count"]) >= 9  # every Linear of the GPT
            bad = [k for k, v in layers.items() if not bool(v)]
            assert not bad, bad


def test_grad_comm_hook_equals_simulation(ranks: list[dict]) -> None:
    from fp8lab.dist.comm import GRAD_COMMS, bytes_per_rank

    for res in ranks:
        for p in GRAD_COMMS:
            assert bool(res[f"comm:{p}"]), p  # DDP gradient == ring_allreduce, bit for bit
            assert float(res[f"comm:{p}:bytes"]) == bytes_per_rank(40, 2, p)
        assert float(res["comm:fp32:err"]) == 0.0
        assert 0 < float(res["comm:fp8:err"]) < 0.2
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0] if k.startswith("comm:"))


def test_straddling_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="straddles the shard boundary at row 100"):
        check_shardable(QuantSpec(granularity=(128, 128)), (200, 256), 2)
    with pytest.raises(ValueError, match="col"):
        check_shardable(QuantSpec(granularity="col"), (256, 256), 2)
    check_shardable(QuantSpec(granularity=(128, 128)), (256, 256), 2)  # aligned: fine
    check_shardable(QuantSpec(granularity="row"), (7, 5), 3)
    check_shardable(QuantSpec(), (7, 5), 3)


def test_shard_rows_is_torch_chunk() -> None:
    w = torch.arange(14.0).reshape(7, 2)
    assert [shard_rows(w, r, 3).shape[0] for r in range(3)] == [3, 3, 1]
    assert torch.equal(torch.cat([shard_rows(w, r, 3) for r in range(3)]), w)
    assert shard_rows(torch.zeros(2, 2), 2, 3).shape == (0, 2)
