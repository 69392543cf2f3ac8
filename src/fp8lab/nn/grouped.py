"""`fp8lab.nn.GroupedLinear`: the expert weights of a mixture-of-experts layer, one grouped GEMM
over jagged token groups.

A grouped GEMM multiplies group ``e`` of the token rows by expert ``e``'s weight. Each expert is
an `fp8lab.nn.Linear` (child ``experts.{e}``), so its three GEMMs (fprop, dgrad, wgrad) run
through that layer's autograd Function under its recipe: its own quantizers, its own plan and its
own delayed-scaling state. The scales are therefore per expert (per group): an expert's
activations and gradients get the amax of its own tokens, as in Transformer Engine's
``GroupedLinear`` (one quantizer per GEMM, ``transformer_engine/pytorch/module/grouped_linear.py``)
and torchao's grouped GEMMs (per-group scales for the 2D-2D weight-gradient GEMM,
``torchao/prototype/moe_training/scaled_grouped_mm.py``).

The real kernels need each group's token count to be a multiple of an alignment, so the groups
are padded with zero rows before the GEMMs (TE's ``Fp8Padding``; Megatron's
``moe_router_padding_for_quantization``) and the padding removed after. `group_alignment` gives
the alignment of a recipe: 1 (no padding) when neither activations nor gradients are quantized;
otherwise the largest block extent along the token axis, at least 16 (TE's
``get_align_size_for_quantization``: 32 for MXFP8, 16 for the per-tensor FP8 recipes; Megatron's
``get_fp8_align_size``: 128 for the 1x128 blockwise recipe, whose weight-gradient GEMM reduces
over tokens in 128x1 tiles). The padding rows are real work of the kernels: they are multiplied
and counted (`GroupedLinear.last_padded_rows`, the cost model), never seen by the caller.

::

    x [T, in] (rows sorted by group), group_sizes [E] (sum T)
    for each group e:  y_e = Linear_e(pad(x_e, to a multiple of align))[:n_e]
    y [T, out]

An empty group runs no GEMM (its expert's weight gets no gradient and its delayed scales do not
move, as a kernel given zero rows does no work for that expert).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8lab.nn.linear import Linear
from fp8lab.nn.saved_activations import layer_recipe
from fp8lab.recipe import Recipe, get_recipe

__all__ = ["MIN_ALIGNMENT", "GroupedLinear", "expert_of", "group_alignment", "padded_sizes"]

#: TE's alignment of the per-tensor FP8 recipes (``get_align_size_for_quantization``)
MIN_ALIGNMENT = 16


def group_alignment(recipe: Recipe | None) -> int:
    """The number of token rows each group is padded to a multiple of under ``recipe`` (see the
    module docstring): 1 when neither ``input`` nor ``grad_output`` is quantized in any GEMM
    (``None``: no recipe), else ``max(16, the largest block extent along the token axis)``."""
    if recipe is None:
        return 1
    align = 1
    for gemm, role in (("fprop", "input"), ("dgrad", "grad_output"), ("wgrad", "input"),
                       ("wgrad", "grad_output")):  # fmt: skip
        if recipe.precision(gemm, role) is not None:
            continue  # a high-precision cell quantizes nothing
        spec = recipe.spec(gemm, role)
        if spec is None:
            continue
        # the natural-layout block (tokens, features): a wgrad reduces over tokens in the
        # transposed block, i.e. the block's feature extent runs along the token axis
        extent = max(b for b in spec.block if b > 0) if any(b > 0 for b in spec.block) else 0
        align = max(align, MIN_ALIGNMENT, extent)
    return align


def expert_of(layer: str) -> tuple[str, int] | None:
    """``("moe.up", 3)`` for the name of a `GroupedLinear`'s expert (``"moe.up.experts.3"``),
    None for any other layer name."""
    head, sep, tail = layer.rpartition(".experts.")
    return (head, int(tail)) if sep and head and tail.isdigit() else None


def padded_sizes(sizes: Sequence[int], align: int) -> list[int]:
    """Each group size rounded up to a multiple of ``align`` (0 stays 0)."""
    return [-(-int(n) // align) * align for n in sizes]


def _sizes(group_sizes: Sequence[int] | torch.Tensor, groups: int, rows: int) -> list[int]:
    sizes = group_sizes.tolist() if isinstance(group_sizes, torch.Tensor) else list(group_sizes)
    if len(sizes) != groups:
        raise ValueError(f"GroupedLinear: {len(sizes)} group sizes for {groups} groups")
    if any(int(n) != n or n < 0 for n in sizes):
        raise ValueError(f"GroupedLinear: group sizes must be integers >= 0, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"GroupedLinear: group sizes sum to {sum(sizes)}, input has {rows} rows")
    return [int(n) for n in sizes]


class GroupedLinear(nn.Module):
    """``num_groups`` experts' ``torch.nn.Linear``-shaped weights applied to jagged token groups.

    ``experts.{e}`` is an `fp8lab.nn.Linear` under ``recipe`` (named ``{name}.experts.{e}``), or a
    plain ``torch.nn.Linear`` with ``recipe=None`` (`fp8lab.nn.convert` swaps those later, as it
    does in the lab's GPT). ``forward(x, group_sizes)``: ``x [T, in_features]`` with the rows of
    group 0 first, then group 1, ...; ``group_sizes`` (E integers >= 0, summing to T) ->
    ``[T, out_features]``. After each forward ``last_rows`` and ``last_padded_rows`` hold the
    routed and the padded row count of every group (lists of E ints).
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        recipe: Recipe | str | None = "te-current",
        name: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
            raise ValueError(
                f"GroupedLinear: num_groups must be an integer >= 1, got {num_groups!r}"
            )
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.name = name
        rec = None if recipe is None else get_recipe(recipe)
        experts: list[nn.Linear] = []
        for e in range(num_groups):
            if rec is None:
                experts.append(nn.Linear(in_features, out_features, bias, device, dtype))
            else:
                ename = None if name is None else f"{name}.experts.{e}"
                experts.append(Linear(in_features, out_features, bias, device, dtype,
                                      recipe=rec, name=ename))  # fmt: skip
        self.experts = nn.ModuleList(experts)
        self.last_rows: list[int] = [0] * num_groups
        self.last_padded_rows: list[int] = [0] * num_groups

    def recipe(self) -> Recipe | None:
        """The recipe the experts run under now (an `fp8lab.nn.autocast` override included;
        ``None``: plain torch experts)."""
        return layer_recipe(self.experts[0])

    def alignment(self) -> int:
        """The padding multiple of the recipe in force (`group_alignment`)."""
        return group_alignment(self.recipe())

    def forward(self, x: torch.Tensor, group_sizes: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"{self.name or 'GroupedLinear'}: input of shape {tuple(x.shape)} is not "
                f"[tokens, {self.in_features}]"
            )
        sizes = _sizes(group_sizes, self.num_groups, x.shape[0])
        padded = padded_sizes(sizes, self.alignment())
        self.last_rows, self.last_padded_rows = sizes, padded
        outs: list[torch.Tensor] = []
        start = 0
        for expert, n, p in zip(self.experts, sizes, padded, strict=True):
            if n == 0:
                continue
            xe = x[start : start + n]
            start += n
            if p > n:  # zero rows: a zero amax contribution and zero products
                xe = F.pad(xe, (0, 0, 0, p - n))
            ye = expert(xe)
            outs.append(ye if p == n else ye[:n])
        if not outs:
            return x.new_zeros(0, self.out_features)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, in_features={self.in_features}, " \
            f"out_features={self.out_features}"  # fmt: skip
