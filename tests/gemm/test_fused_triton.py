"""The Triton kernel of the fused accumulator's FP8 fast domain (`fp8lab.gemm.fused_triton`)
gives numba's bits, run through Triton's interpreter on the CPU (``using_triton("interpret")``
with the torch kernels); its probe catches a wrong kernel and falls back to the torch kernel.

The interpreter executes the kernel's operations in numpy: it shows the arithmetic is right,
not what a GPU compiler makes of it (FMA contraction, flush-to-zero, division): on a GPU the
probe (`verified_kernel`) checks that before first use. Skipped without triton."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_fused import _f32, _validation_sets
from test_torch_kernels import _c, _operand, _same_bits, _unit

from fp8lab import Accumulator, QuantSpec, qmatmul, quantize
from fp8lab.gemm import fused_dot
from fp8lab.gemm import fused_triton as ft
from fp8lab.gemm.fused import fast_path_applies
from fp8lab.kernels import using_kernels

tl = pytest.importorskip("triton.language")
pytestmark = [
    pytest.mark.numba_only,  # compares with numba
    # the interpreter runs the probe's overflowing promotion (-> inf, as torch) in numpy
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


@pytest.fixture
def interpret(monkeypatch):
    """qmatmul on CPU tensors under the torch kernels takes the Triton kernel (interpreter);
    counts the Triton launches."""
    monkeypatch.setattr(ft._TRITON, "value", "interpret")
    calls = []
    real = ft.fused_gemm_triton

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr("fp8lab.gemm.fused.fused_gemm_triton", counted)
    return calls


def _triton_vs_numba(fn, calls):
    with using_kernels("numba"):
        want = fn()
    n0 = len(calls)
    with using_kernels("torch"):
        got = fn()
    assert len(calls) > n0, "the Triton kernel did not run"
    return want, got


FAST = [("h100", ("e4m3", "e4m3")), ("h200", ("e4m3", "e5m2")), ("ada", ("e5m2", "e5m2")),
        ("l40s", ("e5m2", "e4m3"))]  # fmt: skip


@pytest.mark.parametrize(("hw", "fmts"), FAST, ids=str)
def test_gpu_presets_bit_identical(hw, fmts, interpret):
    fa, fb = fmts
    assert fast_path_applies(Accumulator(hw).resolve(fa, fb), fa, fb)
    m, k, n = 19, 75, 21  # ragged tiles (16 x 16) and a ragged last K group
    qa = _unit(_operand((m, k), fa, 11), fa)
    qb = _unit(_operand((k, n), fb, 12), fb)
    c = _c(m, n, 13)
    want, got = _triton_vs_numba(lambda: qmatmul(qa, qb, hw, c=c), interpret)
    _same_bits(got, want)


def test_deepseek_v3_h100_promotion(interpret):
    # DeepSeek-V3's tiling (1x128 activations, 128x128 weights) with the H100 accumulator
    # promoted every 128: the promotion with the block scales happens inside the kernel
    g = torch.Generator().manual_seed(5)
    a = torch.randn(18, 300, generator=g) * 3
    b = torch.randn(300, 20, generator=g)
    a[0, :128] *= 1e-3  # blocks of very different scales
    qa = quantize(a, QuantSpec("e4m3", (1, 128)))
    qb = quantize(b, QuantSpec("e4m3", (128, 128)))
    acc = Accumulator("h100", promote_every=128)
    want, got = _triton_vs_numba(lambda: qmatmul(qa, qb, acc), interpret)
    _same_bits(got, want)


@pytest.mark.parametrize("k", [1, 33])
def test_short_k_and_cancellation(k, interpret):
    a = _operand((4, k), "e4m3", 14)
    a[0], a[1] = 448.0, 0.0  # a row of maxima, a row of zeros (c alone through the steps)
    a[0, k // 2 :] = -448.0  # cancels exactly against the constant column
    b = _operand((k, 7), "e4m3", 15)
    b[:, 0] = 448.0
    # with the zero row: c alone, cut to 13 bits below 2**-126 (subnormal results), huge, -0
    c = torch.tensor(
        [[0.0, -0.0, 2.0**-140, -3e38, 1.0, -(2.0**-130), 3 * 2.0**-139 + 2.0**-149]] * 4
    )
    qa, qb = _unit(a, "e4m3"), _unit(b, "e4m3")
    for acc in ("h100", Accumulator("h100", promote_every=32)):
        want, got = _triton_vs_numba(lambda acc=acc: qmatmul(qa, qb, acc, c=c), interpret)
        _same_bits(got, want)


def test_published_tensor_core_vectors(interpret):
    # real H100 / L40S outputs (Khattak & Mikaitis' validation data): the GEMM path of each
    # vector, a [1, K] x [K, 1] product with its c, through the Triton kernel
    for gpu, hw in (("H100", "h100"), ("L40S", "l40s")):
        rows = _validation_sets()[(gpu, "E4M3")][:12]
        a = torch.stack([_f32(r[0]) for r in rows])
        b = torch.stack([_f32(r[1]) for r in rows])
        c = _f32([r[2] for r in rows])
        d = _f32([r[3] for r in rows])
        with using_kernels("torch"):
            got = torch.stack([
                qmatmul(_unit(a[s : s + 1], "e4m3"), _unit(b[s : s + 1].t().contiguous(), "e4m3"),
                        hw, c=c[s : s + 1].reshape(1, 1)).reshape(())
                for s in range(len(rows))
            ])  # fmt: skip
        _same_bits(got, d)
        _same_bits(got, fused_dot(a, b, hw, ("e4m3", "e4m3"), c=c))


def _zeros_kernel(va, vb, acc_ptr, out_ptr, sa_ptr, sb_ptr, M, N, K, ng, gpp, n_sb,
                  G: tl.constexpr, GP: tl.constexpr, F: tl.constexpr, OUT_BITS: tl.constexpr,
                  EXP_FLOOR: tl.constexpr, EMIN_A: tl.constexpr, EMIN_B: tl.constexpr,
                  PROMOTE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """A wrong kernel: writes zeros."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(acc_ptr + rows[:, None] * N + cols[None, :], tl.zeros((BM, BN), tl.float32), mask=mask)


def test_wrong_kernel_warns_and_falls_back(interpret, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    wrong = InterpretedFunction(_zeros_kernel)
    monkeypatch.setattr(ft, "_jit", lambda interpret: wrong)
    monkeypatch.setattr(ft, "_verified", {})
    qa = _unit(_operand((5, 40), "e4m3", 16), "e4m3")
    qb = _unit(_operand((40, 6), "e4m3", 17), "e4m3")
    with using_kernels("numba"):
        want = qmatmul(qa, qb, "h100")
    with using_kernels("torch"), pytest.warns(RuntimeWarning, match="Triton fused-accumulator"):
        got = qmatmul(qa, qb, "h100")
    _same_bits(got, want)  # the torch kernel's bits
    assert interpret == []
    with using_kernels("torch"), warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per device and model: no second warning
        _same_bits(qmatmul(qa, qb, "h100"), want)


def test_int32_offsets_bound_the_sizes():
    assert ft.fits(4096, 8192, 4096, 32) and ft.fits(1, 2**26, 1, 32)
    assert not ft.fits(65536, 32768, 16, 32) and not ft.fits(16, 2**27, 16, 32)


def test_off_switch_and_cpu_default():
    with ft.using_triton("0"):
        assert ft.triton_mode(torch.device("cpu")) is None
        assert not ft.verified_kernel(Accumulator("h100").resolve("e4m3", "e4m3"),
                                      ("e4m3",) * 2, torch.device("cpu"), True)  # fmt: skip
    with ft.using_triton("1"):
        assert ft.triton_mode(torch.device("cpu")) is None  # the CPU keeps numba / torch
        assert ft.triton_mode(torch.device("cuda")) == "jit"


def test_the_environment_is_read_once(monkeypatch):
    monkeypatch.setattr(ft._TRITON, "value", None)
    monkeypatch.setenv("FP8LAB_TRITON", "interpret")
    assert ft.get_triton() == "interpret"
    monkeypatch.setenv("FP8LAB_TRITON", "0")  # no effect now: set_triton changes it
    assert ft.triton_mode(torch.device("cpu")) == "interpret"
    assert ft.set_triton("0") == "interpret" and ft.triton_mode(torch.device("cuda")) is None
    with ft.using_triton("1"):
        assert ft.get_triton() == "1"
    assert ft.get_triton() == "0"


def test_a_bad_setting_is_an_error_naming_it(monkeypatch):
    monkeypatch.setattr(ft._TRITON, "value", None)
    monkeypatch.setenv("FP8LAB_TRITON", "false")
    msg = "environment variable FP8LAB_TRITON: unknown Triton mode 'false'; choose one of 1, 0"
    with pytest.raises(ValueError, match=msg):
        ft.triton_mode(torch.device("cuda"))
    with pytest.raises(ValueError, match="set_triton: unknown Triton mode 'on'"):
        ft.set_triton("on")
    import fp8lab

    assert fp8lab.set_triton is ft.set_triton and fp8lab.using_triton is ft.using_triton
    assert fp8lab.get_triton is ft.get_triton


def test_status_for_reports():
    with ft.using_triton("interpret"):
        st = ft.triton_status(torch.device("cpu"))
    assert st["mode"] == "interpret" and st["verified"] == {"h100": True, "ada": True}
    assert st["triton"] and "warnings" not in st
    with ft.using_triton("0"):
        assert ft.triton_status(torch.device("cpu"))["verified"] == {}


@pytest.mark.parametrize("promote", [False, True])
def test_compiles_for_hopper_without_fma_ftz_or_float_division(promote):
    # Triton compiles (no GPU needed) to PTX for sm_90: the pitfalls the interpreter cannot
    # show are absent from the code a GPU would run: no fused multiply-add, no flush-to-zero,
    # no float division; float->int conversions truncate (cvt.rzi); the promotion's multiply
    # and add round separately to nearest (mul.rn / add.rn)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp8lab.gemm.fused_triton_kernel import fused_tile

    fn = triton.jit(fused_tile)
    ptrs = ("va", "vb", "acc_ptr", "out_ptr", "sa_ptr", "sb_ptr")
    sig = {
        **dict.fromkeys(ptrs, "*fp32"),
        **dict.fromkeys(("M", "N", "K", "ng", "gpp", "n_sb"), "i32"),
    }
    const = dict(G=32, GP=32, F=13, OUT_BITS=13, EXP_FLOOR=-133, EMIN_A=-6, EMIN_B=-9,
                 PROMOTE=promote, BM=16, BN=16)  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})  # fmt: skip
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=ft.COMPILE_OPTIONS)
    ptx = ptx.asm["ptx"]
    assert "fma." not in ptx and ".ftz" not in ptx
    assert "div.rn.f32" not in ptx and "div.approx" not in ptx and "div.full" not in ptx
    assert "cvt.rzi.s32.f32" in ptx
    if promote:
        assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx
