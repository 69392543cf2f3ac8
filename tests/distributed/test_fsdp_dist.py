"""FP8 all-gather of row shards (uint8 codes + scales) and the --grad-comm DDP hook on 2 gloo
processes; refusals."""

from __future__ import annotations

import pytest
import torch
from _dist_launch import run_ranks

from fp8lab.distributed.fsdp import check_shardable, shard_rows
from fp8lab.qtensor import QuantSpec

# multi-process torch.distributed (gloo) runs: make test-slow
pytestmark = pytest.mark.slow

MODES = "fsdp,fsdp8,fsdp32,ddp8,fsdp8d,fsdp8du,world,fsdp8h,ddph"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    # one 2-process launch: the FP8 all-gather as a function and under fully_shard, the
    # --grad-comm hook, and 3 training steps under FSDP2 (FP8 / fp32 all-gather) and DDP
    # (te-current; te-delayed and hif8-delayed with the FP8 all-gather)
    out = run_ranks(tmp_path_factory.mktemp("fsdp"), 2, MODES)
    return [{k.split(":", 1)[1]: v for k, v in r.items() if k.startswith("fsdp:")} | r
            for r in out]  # fmt: skip


def test_gathered_weight_equals_unsharded_quantization(ranks: list[dict]) -> None:
    for res in ranks:
        for preset in ("te-current", "deepseek-v3", "mxfp8"):
            layers = {
                k: v for k, v in res.items() if k.startswith(f"{preset}:") and "count" not in k
            }
            assert len(layers) == int(res[f"{preset}:count"]) >= 9  # every Linear of the GPT
            bad = [k for k, v in layers.items() if not bool(v)]
            assert not bad, bad
        # delayed scaling: the state's scale on every shard (hif8-delayed's first step: the
        # global amax's current scale), the shard's amax observed
        assert bool(res["te-delayed:delayed"]) and bool(res["hif8-delayed:delayed"])
        # a NaN in one shard is ignored by the amax (te-current, te-delayed, hif8-delayed)
        assert res["nan_shard"].all(), res["nan_shard"]


def test_grad_comm_hook_equals_simulation(ranks: list[dict]) -> None:
    from fp8lab.distributed.comm import GRAD_COMMS, bytes_per_rank

    for res in ranks:
        for p in GRAD_COMMS:
            assert bool(res[f"comm:{p}"]), p  # DDP gradient == ring_allreduce, bit for bit
            assert float(res[f"comm:{p}:bytes"]) == bytes_per_rank(40, 2, p)
        assert float(res["comm:fp32:err"]) == 0.0
        assert 0 < float(res["comm:fp8:err"]) < 0.2
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0] if k.startswith("comm:"))


def test_fsdp_fp8_allgather_under_delayed_scaling_equals_ddp_bit_for_bit(
    ranks: list[dict],
) -> None:
    # te-delayed weights gathered as FP8 codes: each rank quantizes its shard with the weight's
    # delayed scale (the same on every rank) and observes the shard's amax; the step's amax
    # all-reduce (batched, or one per state and update) makes it the whole weight's. Every step's
    # per-token losses, scales and amax histories (all states, the weights' included) and the
    # trained weights equal DDP's bit for bit, and the two ranks' histories are identical.
    # hif8-delayed: its first step quantizes with current scaling (the global amax all-reduced
    # before the gather), then interval 5.
    r0, r1 = ranks
    for mode, ref in (("fsdp8d", "world"), ("fsdp8du", "world"), ("fsdp8h", "ddph")):
        assert list(r0[f"{mode}:names"]) == list(r0[f"{ref}:names"])
        assert any(n.endswith(".weight") for n in r0[f"{mode}:names"]), mode
        for step in range(3):
            for key in ("tokens", "scales", "hist"):
                want = _bits(r0[f"{ref}:{key}{step}"])
                assert torch.equal(_bits(r0[f"{mode}:{key}{step}"]), want), (mode, key, step)
                assert torch.equal(_bits(r1[f"{mode}:{key}{step}"]), want), (mode, key, step)
            assert float(r0[f"{mode}:loss{step}"]) == float(r0[f"{ref}:loss{step}"])
        for r in ranks:
            assert torch.equal(_bits(r[f"{mode}:weights"]), _bits(r0[f"{ref}:weights"])), mode
    # the weight's history holds one amax per step (measured steps), the whole weight's
    hist = r0["fsdp8d:hist2"]
    names = list(r0["fsdp8d:names"])
    w = names.index(next(n for n in names if n.endswith(".weight")))
    assert int((hist[w] != 0).sum()) == 3


def test_fp8_allgather_amax_all_reduces_per_step(ranks: list[dict]) -> None:
    # te-current: every per-tensor weight's amax in one all-reduce per step (at the root's
    # forward; the backward's re-gathers reuse it), not one per gathered weight; te-delayed: no
    # all-reduce before a gather, only the step's batched amax all-reduce, as DDP
    for r in ranks:
        for step in range(3):
            assert int(r[f"fsdp8:max_reduces{step}"]) == 1, step
            assert int(r[f"fsdp8d:max_reduces{step}"]) == int(r[f"world:max_reduces{step}"]) == 1
            n_states = len(r["fsdp8du:names"])  # one all-reduce per state and update
            assert int(r[f"fsdp8du:max_reduces{step}"]) == n_states, step


def test_delayed_weights_with_per_rank_amaxes_are_refused() -> None:
    from fp8lab.distributed.fsdp import check_fp8_allgather_recipe
    from fp8lab.recipe import get_recipe

    check_fp8_allgather_recipe(get_recipe("te-delayed"))  # world: gathered
    with pytest.raises(ValueError, match="recipe 'te-delayed': delayed-scaled weights need "
                                         "--amax-group world"):  # fmt: skip
        check_fp8_allgather_recipe(get_recipe("te-delayed"), "none")
    check_fp8_allgather_recipe(get_recipe("te-current"), "none")  # current scaling: fine


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


def test_fully_shard_fp8_allgather_equals_unsharded_quantization(ranks: list[dict]) -> None:
    # FSDP2's own all-gather, hooked (ShardedWeight.fsdp_pre/post_all_gather): uint8 codes in,
    # the whole weight's QTensor out, equal to quantizing the unsharded weight (values, scales)
    for res in ranks:
        for preset in ("te-current", "deepseek-v3", "mxfp8"):
            pre = f"fs:{preset}:"
            layers = {k: v for k, v in res.items() if k.startswith(pre) and "count" not in k}
            assert len(layers) == int(res[f"{pre}count"]) >= 9  # every fp8lab Linear
            bad = [k for k, v in layers.items() if not bool(v)]
            assert not bad, bad


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_fsdp_training_equals_ddp_bit_for_bit(ranks: list[dict]) -> None:
    # te-current on 2 ranks: FSDP2 gathering FP8 codes, FSDP2 gathering fp32 and DDP give the
    # same per-token losses at every step, bit for bit: the Linear consumes the gathered QTensor
    # (the unsharded quantization), and with 2 ranks the reduce-scatter and the all-reduce add
    # the same two fp32 gradients. (Not a 1-rank run: current scaling takes each rank's local
    # activation amax.)
    r0, r1 = ranks
    for step in range(3):
        want = _bits(r0[f"ddp8:tokens{step}"])
        for mode in ("fsdp8", "fsdp32"):
            assert torch.equal(_bits(r0[f"{mode}:tokens{step}"]), want), (mode, step)
            assert float(r0[f"{mode}:loss{step}"]) == float(r1[f"{mode}:loss{step}"])


def test_fsdp_frees_gathered_weights_between_steps(ranks: list[dict]) -> None:
    # as FSDP2: after each training step no full-size weight gathered for it (float32 or its
    # FP8 codes) is still allocated, and no unsharded Parameter or gathered QTensor holds data;
    # between the forward and the backward the blocks' unsharded weights are freed too
    for res in ranks:
        for mode in ("fsdp8", "fsdp32"):
            for step in range(3):
                assert int(res[f"{mode}:gathered{step}"]) >= 4, (mode, step)  # every Linear
                assert int(res[f"{mode}:alive{step}"]) == 0, (mode, step)
                # reshard after forward: the blocks' weights are re-gathered for the backward
                assert int(res[f"{mode}:fwd_unsharded{step}"]) == 0, (mode, step)
