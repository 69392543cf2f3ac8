"""The preset recipes (`recipes`, `get_recipe`), each from its public source."""

from __future__ import annotations

from typing import Any

from fp8lab.gemm import Accumulator
from fp8lab.qtensor import QuantSpec
from fp8lab.recipe.config import GEMMS, GemmConfig
from fp8lab.recipe.core import Recipe
from fp8lab.recipe.layers import set_preset_lookup
from fp8lab.scaling.delayed import DelayedScalingConfig

__all__ = ["get_recipe", "recipes"]


def _e(fmt: str, gran: Any = "tensor", scaling: Any = "max", **kw: Any) -> QuantSpec:
    return QuantSpec(format=fmt, granularity=gran, scaling=scaling, **kw)


def _hp(precision: str) -> dict[str, GemmConfig]:
    return {g: GemmConfig(high_precision=precision) for g in GEMMS}


def _te_delayed() -> DelayedScalingConfig:
    return DelayedScalingConfig(history_len=1024, algorithm="max", margin=0)


def _deepseek_v3(name: str, acc: Accumulator, description: str, source: str) -> Recipe:
    """The DeepSeek-V3 tiling (1x128 activations/grads, 128x128 weights, all E4M3, BF16 moments)
    with accumulator ``acc`` on all three GEMMs."""
    gemm = GemmConfig(accumulator=acc)
    return Recipe(
        name=name,
        input=_e("e4m3", (1, 128)),
        weight=_e("e4m3", (128, 128)),
        grad_output=_e("e4m3", (1, 128)),
        fprop=gemm,
        dgrad=gemm,
        wgrad=gemm,
        optimizer_state="bf16",
        save_for_backward="quantized",
        description=description,
        source=source,
    )


def _build_presets() -> dict[str, Recipe]:
    te_src = "NVIDIA Transformer Engine transformer_engine/common/recipe/__init__.py"
    ds_src = "DeepSeek-V3 technical report, arXiv 2412.19437v2 §3.3, §3.5.2"
    hif8_src = '"HiFloat8:高性能训练之路" (GCC / Huawei, 2025-12-19); HiFloat8 arXiv 2409.16626'
    mixed_src = '"混合精度训练:FP16、BF16、FP8深度对比"'
    # save_for_backward is stated by every preset: the dataclass default changed to
    # "high_precision" and a preset's fingerprint (run directories resume on it) must not
    ds_acc = Accumulator(kind="limited", mantissa_bits=13, group=32, promote_every=128)
    h100_fast = Accumulator("h100")  # the H100 tensor core, bit-exact (fp8lab.gemm.fused)
    h100_ds = Accumulator("h100", promote_every=128)
    hif8_round = "nearest_away"  # HiF8's native TA rounding (arXiv 2409.16626)
    p: list[Recipe] = [
        Recipe(
            name="fp32",
            **_hp("fp32"),
            save_for_backward="quantized",
            description="Everything in fp32: the reference; fp8lab.nn.Linear == torch.nn.Linear.",
            source="baseline",
        ),
        Recipe(
            name="bf16",
            **_hp("bf16"),
            save_for_backward="quantized",
            description="GEMM operands rounded to bf16 (RNE), fp32 accumulation and output.",
            source=f"standard BF16 mixed precision ({mixed_src}; emulated in fp32, docs/design.md)",
        ),
        Recipe(
            name="fp16-amp",
            **_hp("fp16"),
            save_for_backward="quantized",
            loss_scaling="dynamic",
            loss_scale=2.0**16,
            description="fp16 operands, fp32 accumulation, dynamic loss scaling (2^16, x2/2000, x0.5).",
            source="Micikevicius et al., 'Mixed Precision Training', arXiv 1710.03740; "
            + mixed_src,
        ),
        Recipe(
            name="te-delayed",
            input=_e("e4m3", scaling=_te_delayed()),
            weight=_e("e4m3", scaling=_te_delayed()),
            grad_output=_e("e5m2", scaling=_te_delayed()),
            save_for_backward="quantized",
            description="TE DelayedScaling(): HYBRID (E4M3 fwd, E5M2 grads), per-tensor, amax "
            "history 1024, max, margin 0; fp32 accumulation in all GEMMs.",
            source=te_src + " DelayedScaling",
        ),
        Recipe(
            name="te-delayed-hopper",
            input=_e("e4m3", scaling=_te_delayed()),
            weight=_e("e4m3", scaling=_te_delayed()),
            grad_output=_e("e5m2", scaling=_te_delayed()),
            fprop=GemmConfig(accumulator=h100_fast),
            save_for_backward="quantized",
            description="te-delayed with Hopper's fast FP8 accumulation in fprop (TE "
            "_2X_ACC_FPROP=False: the H100 tensor core's 13-bit fused accumulator, never "
            "promoted, bit-exact model); dgrad/wgrad split-accumulate (fp32).",
            source=te_src + " module/base.py _2X_ACC_*; Khattak & Mikaitis, 'Accurate Models "
            "of NVIDIA Tensor Cores', arXiv 2512.07004 (H100 model)",
        ),
        Recipe(
            name="te-current",
            input=_e("e4m3"),
            weight=_e("e4m3"),
            grad_output=_e("e5m2"),
            save_for_backward="quantized",
            description="TE Float8CurrentScaling(): HYBRID, per-tensor scale fmt_max/amax of the "
            "current tensor; fp32 accumulation.",
            source=te_src + " Float8CurrentScaling",
        ),
        _deepseek_v3(
            "deepseek-v3",
            ds_acc,
            "DeepSeek-V3: E4M3 on all tensors; activations and grads 1x128 tiles, 128x1 for "
            "wgrad (the cached activations re-tiled from the quantized values, the live grads "
            "quantized from high precision), weights 128x128 blocks, "
            "online amax/448 scales; limited accumulation promoted to fp32 every 128; BF16 AdamW "
            "moments, FP32 master weights. Embedding and output head stay high precision.",
            ds_src,
        ),
        _deepseek_v3(
            "deepseek-v3-h100",
            h100_ds,
            "deepseek-v3 with the bit-exact H100 tensor-core accumulator (13-bit "
            "fused block FMA over 32 products) promoted to fp32 every 128, instead of the fast "
            "approximate limited model.",
            ds_src + "; Khattak & Mikaitis, arXiv 2512.07004 (H100 model)",
        ),
        Recipe(
            name="mxfp8",
            input=_e("e4m3", "mx", "mx_rceil"),
            weight=_e("e4m3", "mx", "mx_rceil"),
            grad_output=_e("e4m3", "mx", "mx_rceil"),
            save_for_backward="high_precision",
            description="TE MXFP8BlockScaling(): E4M3 everywhere, 1x32 blocks with E8M0 scales "
            "rounded up (rceil, never clips); rowwise and columnwise copies quantized "
            "independently from the high-precision tensor.",
            source=te_src + " MXFP8BlockScaling; TE quantize_mxfp8.cuh",
        ),
        Recipe(
            name="hif8-current",
            input=_e("hif8", rounding=hif8_round),
            weight=_e("hif8", rounding=hif8_round),
            grad_output=_e("hif8", rounding=hif8_round),
            save_for_backward="quantized",
            description="HiFloat8 on all tensors, per-tensor current scaling, TA rounding.",
            source=hif8_src,
        ),
        Recipe(
            name="hif8-delayed",
            input=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            weight=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            grad_output=_e("hif8", scaling=_hif8_delayed(), rounding=hif8_round),
            save_for_backward="quantized",
            description="HiFloat8 per-tensor delayed scaling: amax measured every 5 steps "
            "(interval 5), guard margin Nguard=8 binades, first step current scaling.",
            source=hif8_src + " (interval 5, Nguard 8-12 for HiF8)",
        ),
        Recipe(
            name="nvfp4",
            input=_e("e2m1", "nvfp4", "nvfp4"),
            weight=_e("e2m1", (16, 16), "nvfp4"),
            grad_output=_e("e2m1", "nvfp4", "nvfp4", rounding="stochastic"),
            save_for_backward="high_precision",
            description="TE NVFP4BlockScaling(): E2M1 elements, 1x16 blocks with E4M3 scales "
            "under an FP32 tensor scale, 16x16 weight blocks, stochastic rounding of grads. "
            "The random Hadamard transform is not modelled.",
            source=te_src + " NVFP4BlockScaling; TE reference_nvfp4.py",
        ),
        *_flavour_presets(te_src),
    ]
    return {r.name: r for r in p}


def _flavour_presets(te_src: str) -> list[Recipe]:
    """The FP4 ablation's starting point and the FP8/FP4 flavours users pick (torchao's float8
    recipes, TE's MXFP8 with 2D weight blocks, OCP MXFP4)."""
    ao_src = "torchao torchao/float8/config.py Float8LinearConfig.from_recipe_name"
    mx_src = "OCP Microscaling Formats (MX) v1.0 §6.3"
    te_nvfp4 = te_src + " NVFP4BlockScaling"
    nv = {
        "input": _e("e2m1", "nvfp4", "nvfp4"),
        "weight": _e("e2m1", (16, 16), "nvfp4"),
        "grad_output": _e("e2m1", "nvfp4", "nvfp4", rounding="stochastic"),
        "save_for_backward": "high_precision",
    }
    fos = {"four_over_six": "mae", "four_over_six_use_256": True}
    # Quartet's backward operands: Hadamard over 32, the block amax never clipped, SR
    qb = _e("e2m1", "mx", "mx_rceil", rounding="stochastic", hadamard=32)
    return [
        Recipe(
            name="nvfp4-te",
            **nv,
            rht_gemms="wgrad",
            description="TE NVFP4BlockScaling() defaults: E2M1, 1x16 E4M3 block scales under an "
            "FP32 tensor scale, 16x16 weight tiles, stochastic rounding of grads, and the "
            "16-point random Hadamard transform on the wgrad GEMM's two operands (the "
            "column-wise copies of x and dy, bf16 before the transform) along the token axis.",
            source=te_nvfp4 + " (QParams: RHT on fwd input and bwd grad, column-wise usage "
            "only); TE custom_recipes/reference_nvfp4.py",
        ),
        Recipe(
            name="nvfp4-paper",
            **nv,
            rht_gemms="wgrad",
            hp_last_blocks=None,
            description="nvfp4-te plus the NVFP4 paper's high-precision layers: the last "
            "max(1, round(0.15 * n_blocks)) blocks in bf16 (hp_last_blocks = auto), resolved "
            "by convert against the model's numbered blocks.",
            source="arXiv 2509.25149 §4 (about 15 % of the linear layers in BF16, mostly the "
            "last blocks); " + te_nvfp4,
        ),
        Recipe(
            name="nvfp4-bare",
            input=_e("e2m1", "nvfp4", "nvfp4"),
            weight=_e("e2m1", "nvfp4", "nvfp4"),
            grad_output=_e("e2m1", "nvfp4", "nvfp4"),
            save_for_backward="high_precision",
            description="NVFP4 with none of the NVFP4 paper's four techniques: 1x16 E4M3 block "
            "scales under an FP32 tensor scale on every tensor (weights too), round to nearest, "
            "no Hadamard transform, no high-precision layers. The ablation's starting point.",
            source=te_src + " NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding="
            "True, disable_2d_quantization=True); arXiv 2509.25149 §4",
        ),
        Recipe(
            name="nvfp4-4over6",
            input=_e("e2m1", "nvfp4", "nvfp4", **fos),
            weight=_e("e2m1", (16, 16), "nvfp4", **fos),
            grad_output=_e("e2m1", "nvfp4", "nvfp4", rounding="stochastic", **fos),
            save_for_backward="high_precision",
            description="nvfp4-te without the Hadamard transform and with 4over6 on input, "
            "weight and grad_output (TE's scope 'all'): per block the better of the map-to-6 "
            "and map-to-4 scales by MAE, global E4M3 bound 256.",
            source=te_nvfp4 + "(nvfp4_4over6='all', nvfp4_4over6_err_mode='MAE', "
            "nvfp4_4over6_e4m3_use_256='all', disable_rht=True); arXiv 2512.02010",
        ),
        Recipe(
            name="torchao-tensorwise",
            input=_e("e4m3"),
            weight=_e("e4m3"),
            grad_output=_e("e5m2"),
            save_for_backward="high_precision",
            description="torchao float8 TENSORWISE (Float8LinearConfig()): dynamic per-tensor "
            "scaling, E4M3 input and weight, E5M2 grad_output; each GEMM's copies cast from the "
            "high-precision tensors.",
            source=ao_src + " TENSORWISE",
        ),
        Recipe(
            name="torchao-rowwise",
            input=_e("e4m3", "row", "pow2_down"),
            weight=_e("e4m3", "row", "pow2_down"),
            grad_output=_e("e4m3", "row", "pow2_down"),
            save_for_backward="high_precision",
            description="torchao float8 ROWWISE: E4M3 everywhere, one scale per row along each "
            "GEMM's reduction axis (axiswise), scales rounded down to powers of two "
            "(round_scales_to_power_of_2=True).",
            source=ao_src + " ROWWISE",
        ),
        Recipe(
            name="torchao-rowwise-gw-hp",
            input=_e("e4m3", "row"),
            weight=_e("e4m3", "row"),
            grad_output=_e("e4m3", "row"),
            dgrad=GemmConfig(overrides={"weight": _e("e4m3")}),
            wgrad=GemmConfig(high_precision="bf16"),
            save_for_backward="high_precision",
            description="torchao float8 ROWWISE_WITH_GW_HP: fprop axiswise E4M3 input and "
            "weight; dgrad axiswise E4M3 grad_output with a per-tensor E4M3 weight; wgrad in "
            "high precision (bf16 operands). Scales not rounded to powers of two (torchao "
            "sets that for ROWWISE only).",
            source=ao_src + " ROWWISE_WITH_GW_HP",
        ),
        Recipe(
            name="mxfp8-2d",
            input=_e("e4m3", "mx", "mx_rceil"),
            weight=_e("e4m3", (32, 32), "mx_rceil"),
            grad_output=_e("e4m3", "mx", "mx_rceil"),
            save_for_backward="high_precision",
            description="TE MXFP8BlockScaling(enable_2d_quantization=True): as mxfp8, but the "
            "weight of a Linear shares one E8M0 scale per 32x32 tile (one amax per tile, "
            "rounded up), so its row- and column-wise copies hold the same values.",
            source=te_src + " MXFP8BlockScaling; TE pytorch/quantization.py "
            "MXFP8BlockScalingRecipeState, common/cast/mxfp8/quantize_mxfp8.cuh "
            "kIs2DBlockScaling",
        ),
        Recipe(
            name="mxfp4",
            input=_e("e2m1", "mx", "mx_floor"),
            weight=_e("e2m1", "mx", "mx_floor"),
            grad_output=_e("e2m1", "mx", "mx_floor"),
            save_for_backward="high_precision",
            description="MXFP4: E2M1 elements, 1x32 blocks with E8M0 scales by the OCP floor "
            "rule (2^(floor(log2 amax) - 2): a block's largest values may saturate at 6), round "
            "to nearest, every tensor.",
            source=mx_src,
        ),
        Recipe(
            name="mxfp4-quartet",
            input=_e("e2m1", "mx", "quest", hadamard=32),
            weight=_e("e2m1", "mx", "quest", hadamard=32),
            grad_output=qb,
            dgrad=GemmConfig(overrides={"weight": qb}),
            wgrad=GemmConfig(overrides={"input": qb}),
            save_for_backward="high_precision",
            description="Quartet: MXFP4 (E2M1, 1x32 E8M0 blocks) after a Hadamard transform "
            "over 32-element blocks along each GEMM's reduction axis; forward QuEST scales "
            "(from the block's standard deviation, round to nearest, clipping); backward "
            "operands with the block amax never clipped (E8M0 rounded up) and stochastic "
            "rounding. Each backward operand is quantized from the high-precision tensor.",
            source="Castro et al., 'Quartet: Native FP4 Training Can Be Optimal for Large "
            "Language Models', arXiv 2505.14669 §3-4",
        ),
    ]


def _hif8_delayed() -> DelayedScalingConfig:
    return DelayedScalingConfig(
        history_len=1024, algorithm="max", margin=0, interval=5, nguard=8, first_step="current"
    )


_PRESETS: dict[str, Recipe] | None = None


def _presets() -> dict[str, Recipe]:
    global _PRESETS
    if _PRESETS is None:
        _PRESETS = _build_presets()
    return _PRESETS


def recipes() -> list[str]:
    """Names of the preset recipes."""
    return list(_presets())


def get_recipe(name: str | Recipe) -> Recipe:
    """The preset ``name`` (a `Recipe` passes through). Unknown names raise, listing valid ones.

    Presets are immutable configuration (delayed scaling as a frozen `DelayedScalingConfig`):
    quantizing under a preset's spec never changes the preset; each quantizing module owns its
    state (`DelayedScaling.bind`), so a preset can be shared by any number of layers and runs.
    """
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
    pres = _presets()
    if name not in pres:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(pres)}")
    return pres[name]


set_preset_lookup(get_recipe)  # recipe files' `base = "PRESET"` and [[layer]] `base` resolve here
