"""fp8lab.distributed.runtime without a process group: torchrun detection, --jobs, agree_any."""

from __future__ import annotations

import pytest

from fp8lab.distributed.data import shard_batch
from fp8lab.distributed.runtime import agree_any, check_jobs, init_from_env, under_torchrun


def test_jobs_under_torchrun_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert under_torchrun()
    with pytest.raises(ValueError, match="--jobs 3 cannot be combined with torchrun"):
        check_jobs(3)
    check_jobs(1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not under_torchrun()
    check_jobs(3)
    assert init_from_env() is None


def test_agree_any_without_a_group() -> None:
    assert agree_any(True) and not agree_any(False)


def test_shard_batch_needs_a_divisible_batch() -> None:
    import torch

    x = torch.arange(12).reshape(6, 2)
    assert torch.equal(shard_batch(x, x, 1, 3)[0], x[2:4])
    with pytest.raises(
        ValueError, match="global batch size 6 is not divisible by the world size 4"
    ):
        shard_batch(x, x, 0, 4)


def test_rank_and_world_without_and_with_a_one_rank_group(tmp_path) -> None:
    """The one rank/world helper: (0, 1) without a group; the group's values inside one."""
    import torch.distributed as d

    from fp8lab.distributed.runtime import is_distributed, rank, world_size

    assert not is_distributed() and (rank(), world_size()) == (0, 1)
    store = d.FileStore(str(tmp_path / "store"), 1)
    d.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert is_distributed() and (rank(), world_size()) == (0, 1)
        assert world_size(d.new_group([0])) == 1
    finally:
        d.destroy_process_group()
    assert not is_distributed()
