"""Collective bytes per rank and step, against counts derived by hand from tensor sizes and formats.

Conventions (docs/cost.md, `fp8lab.cost.collectives`): a ring all-reduce sends 2(N-1)/N of the
data per rank, a reduce-scatter or all-gather (N-1)/N; fp8 grad-comm adds a 4-byte scale per
message (2(N-1) per bucket in an all-reduce, N-1 in a reduce-scatter), fp8-msamp one 4-byte amax
all-reduce per bucket ((N-1) x 4 bytes); every amax all-reduce of k float32 amaxes costs
(N-1) x 4k bytes per rank. FSDP gathers each weight twice per step (forward, backward).
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
    # te-delayed: x, W and dy of every Linear, one float32 amax each per step
    c = collective_bytes("te-delayed", LINS, ranks=N)
    assert c.amax_allreduces == 3 * 2
    assert c.amax_allreduce == 3 * 2 * (N - 1) * 4
    # current scaling under DDP: every rank computes its own amax, nothing to reduce
    assert collective_bytes("te-current", LINS, ranks=N).amax_allreduces == 0
    assert collective_bytes("te-current", LINS, ranks=N).fsdp_allgather == 0


def test_fsdp_all_gathers_hand_derived():
    gather = (N - 1) / N
    # te-current: FP8 codes + one FP32 scale per weight, gathered twice; the per-tensor amax is
    # all-reduced before each gather; gradients reduce-scattered in fp32
    c = collective_bytes("te-current", LINS, ranks=N, fsdp=True)
    assert c.fsdp_allgather == gather * 2 * sum(w + 4 for w in WEIGHTS)
    assert c.amax_allreduces == 2 * 2 and c.amax_allreduce == 4 * (N - 1) * 4
    assert c.grad_reduce == gather * 4 * NUMEL
    # te-delayed: same codes; the scale is known before the gather (no extra all-reduce)
    d = collective_bytes("te-delayed", LINS, ranks=N, fsdp=True)
    assert d.fsdp_allgather == c.fsdp_allgather and d.amax_allreduces == 3 * 2
    # mxfp8: forward gathers the row-wise copy, backward the column-wise one (quantized again
    # from bf16, so it cannot be derived from the row-wise codes): E8M0 per 32 elements each
    mx = collective_bytes("mxfp8", LINS, ranks=N, fsdp=True)
    assert mx.fsdp_allgather == gather * sum(2 * (w + w // 32) for w in WEIGHTS)
    assert mx.amax_allreduces == 0
    # deepseek-v3: 128x128 weight blocks, FP32 scales; dgrad transposes the same copy
    ds = collective_bytes("deepseek-v3", LINS, ranks=N, fsdp=True)
    assert ds.fsdp_allgather == gather * 2 * sum(w + 4 * (w // 128**2) for w in WEIGHTS)
    # nvfp4: 4-bit codes, an E4M3 scale per 16x16 block + the FP32 tensor scale, whose amax is
    # all-reduced before each gather
    fp4 = collective_bytes("nvfp4", LINS, ranks=N, fsdp=True)
    assert fp4.fsdp_allgather == gather * 2 * sum(w // 2 + w // 256 + 4 for w in WEIGHTS)
    assert fp4.amax_allreduces == 2 * 2
    # bf16 weights in bf16, other parameters in bf16; an all-fp32 recipe gathers fp32
    bf = collective_bytes("bf16", LINS, ranks=N, fsdp=True, other=1000)
    assert bf.fsdp_allgather == gather * 2 * (2 * NUMEL + 2 * 1000)
    f32 = collective_bytes("fp32", LINS, ranks=N, fsdp=True, other=1000)
    assert f32.fsdp_allgather == gather * 2 * (4 * NUMEL + 4 * 1000)
    # the reduce-scatter's fp8 scales: N-1 messages per bucket
    rs = collective_bytes("bf16", LINS, ranks=N, fsdp=True, grad_comm="fp8")
    assert rs.grad_reduce == gather * NUMEL + (N - 1) * 4


def test_one_rank_and_bad_input():
    one = collective_bytes("te-delayed", LINS, ranks=1, fsdp=True)
    assert one.total == 0 and one.amax_allreduces == 0
    with pytest.raises(ValueError, match="ranks"):
        collective_bytes("bf16", LINS, ranks=0)
    with pytest.raises(ValueError, match="fp16"):
        collective_bytes("bf16", LINS, ranks=2, grad_comm="fp16")
    c = collective_bytes("te-delayed", LINS, ranks=2, grad_comm="bf16", fsdp=True)
    d = c.to_dict()
    assert set(d) == {"grad_reduce_bytes", "amax_allreduce_bytes", "amax_allreduces",
                      "fsdp_allgather_bytes", "total_bytes"}  # fmt: skip
    assert d["total_bytes"] == d["grad_reduce_bytes"] + d["amax_allreduce_bytes"] + d[
        "fsdp_allgather_bytes"]  # fmt: skip
