"""--amax-group world|none on 2 gloo processes against a 1-rank run on the same global batch,
and the batched amax all-reduce against one all-reduce per state."""

from __future__ import annotations

import pytest
import torch
from _dist_launch import run_ranks

# multi-process torch.distributed (gloo) runs: make test-slow
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("amax")
    (one,) = run_ranks(tmp, 1, "world")  # the 1-rank reference (no process group)
    two = run_ranks(tmp, 2, "world,none,unbatched")  # one launch for the three modes

    def mode(res: dict, name: str) -> dict:
        return {k.split(":", 1)[1]: v for k, v in res.items() if k.startswith(name + ":")}

    return {
        "one": [mode(one, "world")],
        **{m: [mode(r, m) for r in two] for m in ("world", "none", "unbatched")},
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_world_scales_identical_and_first_step_equals_one_rank(runs: dict) -> None:
    (one,), (r0, r1) = runs["one"], runs["world"]
    for step in range(3):
        # identical on both ranks, bit for bit (each rank also asserted it in-process)
        assert torch.equal(_bits(r0[f"scales{step}"]), _bits(r1[f"scales{step}"]))
        assert float(r0[f"spread{step}"].abs().max()) == 0.0
    # the first step: the global batch's per-token losses and the updated scales, bit for bit
    assert torch.equal(_bits(r0["tokens0"]), _bits(one["tokens0"]))
    assert torch.equal(_bits(r0["scales0"]), _bits(one["scales0"]))
    assert not torch.equal(one["scales0"], torch.ones_like(one["scales0"]))  # they did update
    # DataParallel's loss: the same float on both ranks, the global batch's mean
    for step in range(3):
        assert float(r0[f"loss{step}"]) == float(r1[f"loss{step}"])
        assert abs(float(r0[f"loss{step}"]) - float(r0[f"tokens{step}"].mean())) < 1e-5
    # later steps: the fp32 gradient sum order differs -> close, measured tolerance
    for step in (1, 2):
        a, b = r0[f"tokens{step}"].mean(), one[f"tokens{step}"].mean()
        assert abs(float(a - b)) <= 1e-5 * abs(float(b)), (step, float(a), float(b))


def test_batched_amax_reduction_is_one_all_reduce_and_changes_nothing(runs: dict) -> None:
    (r0, _), (u0, _) = runs["world"], runs["unbatched"]
    assert int(r0["amax_flushes"]) == 3  # one all-reduce per step for all 15 states
    assert len(r0["names"]) > 10
    for step in range(3):  # deferring the updates to the end of the backward changes no bit
        assert torch.equal(_bits(r0[f"scales{step}"]), _bits(u0[f"scales{step}"]))
        assert torch.equal(_bits(r0[f"tokens{step}"]), _bits(u0[f"tokens{step}"]))


def test_none_keeps_local_amaxes(runs: dict) -> None:
    r0, r1 = runs["none"]
    # runtime helpers: a guard decision of one rank is every rank's; rank 0 gets rank 1's states
    for r in (r0, r1):
        assert r["agree"].tolist() == [True, False]
        assert int(r["states_ranks"]) == 2
        assert torch.equal(r["states_scale_r1"], r1["scales2"])
    spread = r0["spread0"]
    assert float(spread.max()) > 0  # the input amaxes of the two halves differ
    assert torch.equal(spread, r1["spread0"])
    assert not torch.equal(r0["scales0"], r1["scales0"])
    # DataParallel.state(): the largest spread after the last step, in binades
    assert float(r0["state"]) == float(r0["spread2"].max())
