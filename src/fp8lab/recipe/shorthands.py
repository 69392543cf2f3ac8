"""Recipe keys that stand for settings of other keys: ``backward_override`` (Transformer
Engine's), ``rht_gemms`` (where TE's random Hadamard transform applies) and the high-precision
blocks ``hp_last_blocks`` / ``hp_first_blocks`` (resolved against a model by
`fp8lab.nn.convert`).

* ``backward_override = "high_precision"`` is ``[dgrad]`` and ``[wgrad]`` ``high_precision =
  "bf16"``; ``"dequantized"`` is those plus ``operand_source = "saved_dequantized"`` (x and W are
  the forward's quantized copies, dequantized and rounded to bf16; dy is bf16). TE
  (transformer_engine/pytorch/module/linear.py) turns its backward quantizers off and feeds the
  backward GEMMs the original (``high_precision``) or the dequantized (``dequantized``) operands
  in the activation dtype; TE's ``DelayedScaling`` refuses any override
  (transformer_engine/common/recipe/__init__.py). `expand_backward_override` writes the
  expansion into the recipe's GEMMs, so the shorthand and the expanded recipe run the same plan.
* ``rht_gemms = "wgrad"``: TE's ``NVFP4BlockScaling`` transforms the column-wise copies of the
  input and of the output gradient, i.e. the two operands of the wgrad GEMM, along the token
  axis (the GEMM's reduction axis), so the transforms cancel in the product
  (``(H x)ᵀ (H dy) = xᵀ dy`` for an orthogonal ``H``). `Recipe.spec` gives those two operands
  ``rht=True``; both must be quantized NVFP4 1x16 specs (one transformed operand alone would not
  cancel), unless the wgrad GEMM runs in high precision (then nothing is transformed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fp8lab.recipe.config import GEMM_OPERANDS, ROLES

__all__ = [
    "BACKWARD_OVERRIDES",
    "RHT_GEMMS",
    "check_hp_blocks",
    "check_rht_gemms",
    "expand_backward_override",
    "hp_block_count",
    "hp_last_from_plain",
    "plain_hp_last",
]

BACKWARD_OVERRIDES = ("none", "high_precision", "dequantized")
RHT_GEMMS = ("none", "wgrad")


def expand_backward_override(recipe: Any) -> dict[str, Any]:
    """The ``dgrad``/``wgrad`` `GemmConfig` changes ``recipe.backward_override`` stands for
    (empty for ``"none"``). ValueError on delayed scaling (TE refuses it) and where the recipe
    already sets those keys otherwise."""
    mode = recipe.backward_override
    if mode not in BACKWARD_OVERRIDES:
        raise ValueError(f"backward_override must be one of {BACKWARD_OVERRIDES}, got {mode!r}")
    if mode == "none":
        return {}
    delayed = [r for r in ROLES if (s := getattr(recipe, r)) is not None and s.is_delayed]
    if delayed:
        raise ValueError(
            f"backward_override={mode!r} on delayed scaling ({', '.join(delayed)}): Transformer "
            "Engine's DelayedScaling supports only backward_override=None; use current, block, "
            "MXFP8 or NVFP4 scaling"
        )
    deq = mode == "dequantized"
    out = {}
    for g in ("dgrad", "wgrad"):
        cfg = recipe.gemm(g)
        if cfg.high_precision not in (None, "bf16"):
            raise ValueError(
                f"backward_override={mode!r} runs [{g}] in bf16; the recipe sets "
                f"[{g}] high_precision = {cfg.high_precision!r}"
            )
        # "dequantized" takes every earlier copy dequantized; "high_precision" must not
        allowed = (
            ("auto", "saved_dequantized") if deq else ("auto", "high_precision", "saved_quantized")
        )
        clash = {r: s for r, _ in GEMM_OPERANDS[g] if (s := cfg.source(r)) not in allowed}
        if clash:
            raise ValueError(
                f"backward_override={mode!r} sets [{g}] operand_source = "
                f"{'saved_dequantized' if deq else 'auto'!r}; the recipe sets {clash}"
            )
        src = "saved_dequantized" if deq else cfg.operand_source
        out[g] = dataclasses.replace(cfg, high_precision="bf16", operand_source=src)
    return out


def check_rht_gemms(recipe: Any) -> None:
    """ValueError unless ``recipe.rht_gemms`` is valid for its wgrad operands (see the module
    docstring): both quantized, or the wgrad GEMM in high precision."""
    if recipe.rht_gemms not in RHT_GEMMS:
        raise ValueError(f"rht_gemms must be one of {RHT_GEMMS}, got {recipe.rht_gemms!r}")
    if recipe.rht_gemms == "none" or recipe.wgrad.high_precision is not None:
        return
    quantized = {
        r: recipe.precision("wgrad", r) is None and recipe.role_spec("wgrad", r) is not None
        for r, _ in GEMM_OPERANDS["wgrad"]
    }
    if not all(quantized.values()):
        raise ValueError(
            "rht_gemms='wgrad' transforms both wgrad operands so that the transforms cancel; "
            f"quantized: {quantized}. Quantize both (NVFP4 1x16) or run [wgrad] in high precision"
        )
    srcs = {r: recipe.wgrad.source(r) for r, _ in GEMM_OPERANDS["wgrad"]}
    saved = {r: s for r, s in srcs.items() if s.startswith("saved_")}
    if saved:
        raise ValueError(
            "rht_gemms='wgrad': the transformed copies are quantized from the high-precision "
            f"tensors (TE), not from the forward's copies; [wgrad] operand_source sets {saved}"
        )
    for r, _ in GEMM_OPERANDS["wgrad"]:
        recipe.spec("wgrad", r)  # a spec that cannot take rht (not NVFP4 1x16) raises here


def check_hp_blocks(last: Any, first: Any) -> None:
    """Types and ranges of ``hp_last_blocks`` (an int >= 0, or None: the paper's share) and
    ``hp_first_blocks`` (an int >= 0)."""
    ok_last = last is None or (isinstance(last, int) and not isinstance(last, bool) and last >= 0)
    if not ok_last:
        raise ValueError(f"hp_last_blocks must be an integer >= 0 or None, got {last!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"hp_first_blocks must be an integer >= 0, got {first!r}")


def hp_block_count(last: int | None, n_blocks: int) -> int:
    """The number of last blocks kept in high precision: ``last``, or for None the NVFP4 paper's
    share (arXiv 2509.25149: about 15 % of the linear layers in BF16),
    ``max(1, round(0.15 * n_blocks))`` (Python's round: half to even)."""
    return max(1, round(0.15 * n_blocks)) if last is None else last


def plain_hp_last(value: Any) -> Any:
    """``hp_last_blocks`` in plain data: None (the paper's share) is written ``"auto"`` (TOML has
    no null)."""
    return "auto" if value is None else value


def hp_last_from_plain(value: Any) -> Any:
    """Inverse of `plain_hp_last` (``"auto"`` or JSON null -> None)."""
    return None if value in ("auto", None) else value
