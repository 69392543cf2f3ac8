"""Collective bytes per rank and step, against counts derived by hand from tensor sizes and formats.

Conventions (docs/cost.md, `fp8lab.cost.collectives`): a ring all-reduce sends 2(N-1)/N of the
data per rank, a reduce-scatter or all-gather (N-1)/N; fp8 grad-comm adds a 4-byte scale per
message (2(N-1) per bucket), fp8-msamp one 4-byte amax all-reduce per bucket ((N-1) x 4 bytes,
`fp8lab.distributed.comm`'s count); the step's delayed-scaling amaxes travel in one batched all-reduce
(DataParallel's default); FSDP gathers each weight twice per step (forward, backward) and
reduce-scatters float32 gradients.
"""

from __future__ import annotations

import pytest

from fp8lab.cost import collective_bytes

N = 4
# two Linears: (name, in, out); every dimension a multiple of 128
LINS = [("a", 256, 640), ("b", 384, 128)]
WEIGHTS = [o * i for _, i, o in LINS]  # elements of each weight [out, in]
NUMEL = sum(WEIGHTS)


def test_ddp_gradient_all_reduce_by_precision():
    ring = 2 * (N - 1) / N
    assert collective_bytes("bf16", LINS, ranks=N).grad_reduce == ring * 4 * NUMEL
    assert collective_bytes("bf16", LINS, ranks=N, grad_comm="bf16").grad_reduce == (
        ring * 2 * NUMEL
    )
    # fp8 in buckets of 100,000 elements: ceil(212,992 / 100,000) = 3 buckets
    fp8 = collective_bytes("bf16", LINS, ranks=N, grad_comm="fp8", bucket_numel=100_000)
    assert fp8.grad_reduce == ring * 1 * NUMEL + 2 * (N - 1) * 4 * 3
    ms = collective_bytes("bf16", LINS, ranks=N, grad_comm="fp8-msamp", bucket_numel=100_000)
    assert ms.grad_reduce == ring * 1 * NUMEL + (N - 1) * 4 * 3
    # other parameters' gradients are reduced too
    other = collective_bytes("bf16", LINS, ranks=N, other=1000)
    assert other.grad_reduce == ring * 4 * (NUMEL + 1000)


def test_amax_all_reduces_of_delayed_scaling():
    ring = 2 * (N - 1) / N
    # te-delayed: x, W and dy of every Linear, one float32 amax each per step, in one buffer
    c = collective_bytes("te-delayed", LINS, ranks=N)
    assert c.amax_allreduces == 1 and c.amax_allreduce == ring * 4 * 3 * 2
    # unbatched: one all-reduce per tensor, the same bytes
    u = collective_bytes("te-delayed", LINS, ranks=N, batch_amax=False)
    assert u.amax_allreduces == 6 and u.amax_allreduce == c.amax_allreduce
    # local amaxes: nothing reduced
    assert collective_bytes("te-delayed", LINS, ranks=N, amax_group="none").amax_allreduce == 0
    # current scaling under DDP: every rank computes its own amax, nothing to reduce
    assert collective_bytes("te-current", LINS, ranks=N).amax_allreduces == 0
    assert collective_bytes("te-current", LINS, ranks=N).fsdp_allgather == 0


def test_fsdp_all_gathers_hand_derived():
    gather, ring = (N - 1) / N, 2 * (N - 1) / N
    # without the FP8 all-gather: bf16 weights (and other parameters), twice per step; the
    # gradients reduce-scattered in float32
    hp = collective_bytes("te-current", LINS, ranks=N, fsdp=True, other=1000)
    assert hp.fsdp_allgather == gather * 2 * 2 * (NUMEL + 1000)
    assert hp.grad_reduce == gather * 4 * (NUMEL + 1000) and hp.amax_allreduces == 0
    f32 = collective_bytes("fp32", LINS, ranks=N, fsdp=True, other=1000)
    assert f32.fsdp_allgather == gather * 2 * 4 * (NUMEL + 1000)

    def fp8(recipe, **kw):
        return collective_bytes(recipe, LINS, ranks=N, fsdp=True, fp8_allgather=True, **kw)

    # te-current: FP8 codes + one FP32 scale per weight, gathered twice; the per-tensor amaxes
    # of both weights are all-reduced once per step, before the forward's gathers (one
    # all-reduce of two floats; the backward's re-gathers reuse them)
    c = fp8("te-current")
    assert c.fsdp_allgather == gather * 2 * sum(w + 4 for w in WEIGHTS)
    assert c.amax_allreduces == 1 and c.amax_allreduce == ring * 4 * 2
    # te-delayed: the same codes; the scale is known before the gather, only the step's batch
    d = fp8("te-delayed")
    assert d.fsdp_allgather == c.fsdp_allgather
    assert d.amax_allreduces == 1 and d.amax_allreduce == ring * 4 * 6
    # mxfp8: forward gathers the row-wise copy, backward the column-wise one (quantized again
    # from high precision): E8M0 per 32 elements each
    mx = fp8("mxfp8")
    assert mx.fsdp_allgather == gather * sum(2 * (w + w // 32) for w in WEIGHTS)
    assert mx.amax_allreduces == 0
    # deepseek-v3: 128x128 weight blocks, FP32 scales; dgrad transposes the same copy
    ds = fp8("deepseek-v3")
    assert ds.fsdp_allgather == gather * 2 * sum(w + 4 * (w // 128**2) for w in WEIGHTS)
    # nvfp4: 4-bit codes, an E4M3 scale per 16x16 block + the FP32 tensor scale, whose amax is
    # all-reduced before each gather
    fp4 = fp8("nvfp4")
    assert fp4.fsdp_allgather == gather * 2 * sum(w // 2 + w // 256 + 4 for w in WEIGHTS)
    assert fp4.amax_allreduces == 2 * 2
    # a bf16 recipe has nothing to gather as FP8
    assert fp8("bf16").fsdp_allgather == gather * 2 * 2 * NUMEL


def test_one_rank_and_bad_input():
    one = collective_bytes("te-delayed", LINS, ranks=1, fsdp=True, fp8_allgather=True)
    assert one.total == 0 and one.amax_allreduces == 0
    with pytest.raises(ValueError, match="ranks"):
        collective_bytes("bf16", LINS, ranks=0)
    with pytest.raises(ValueError, match="fp16"):
        collective_bytes("bf16", LINS, ranks=2, grad_comm="fp16")
    with pytest.raises(ValueError, match="reduce-scattered in fp32"):
        collective_bytes("bf16", LINS, ranks=2, grad_comm="bf16", fsdp=True)
    with pytest.raises(ValueError, match="needs --fsdp"):
        collective_bytes("bf16", LINS, ranks=2, fp8_allgather=True)
    d = collective_bytes("te-delayed", LINS, ranks=2, fsdp=True).to_dict()
    assert set(d) == {"grad_reduce_bytes", "amax_allreduce_bytes", "amax_allreduces",
                      "fsdp_allgather_bytes", "total_bytes"}  # fmt: skip
    assert d["total_bytes"] == d["grad_reduce_bytes"] + d["amax_allreduce_bytes"] + d[
        "fsdp_allgather_bytes"]  # fmt: skip
