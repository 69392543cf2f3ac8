"""A mixture-of-experts SwiGLU block: an fp32 top-k router, token dispatch in the recipe's wire
format, three `fp8lab.nn.GroupedLinear` expert GEMMs, and the weighted combine.

::

    x [T, C] --router (fp32)--> top-k experts and gates per token
      --permute (tokens sorted by expert) --dispatch wire--> xs [T*k, C]
      --gate, up: GroupedLinear --silu(gate) * up--> h --down: GroupedLinear--> ys [T*k, C]
      --combine wire--> y[t] = sum over the token's k experts of gate * ys   [T, C]

**Router.** ``logits = x W_rᵀ`` in fp32 (the router weight is a plain Parameter, never
converted, and runs outside ``torch.autocast``; Megatron's ``--moe-router-dtype fp32``), then
one of two scorings (``router``):

* ``"softmax"`` (the default): the top-k logits per token and their softmax as gates:
  Mixtral's gating ``G(x) = Softmax(TopK(x W_g))`` (arXiv 2401.04088, eq. 1).
* ``"sigmoid"``: DeepSeek-V3 (arXiv 2412.19437, section 2.1.2; ``Gate.forward`` of
  deepseek-ai/DeepSeek-V3 ``inference/model.py``): affinities ``s = sigmoid(logits)``, the
  top-k of ``s + b`` selects the experts, the gates are the selected ``s`` normalised to sum 1
  (the bias ``b`` is for selection only; no ``route_scale``, no group-limited routing).
  Auxiliary-loss-free balancing: after each training forward (one per step in the lab) every
  expert's bias moves by ``bias_update_speed`` towards balance, ``b_i += γ sign(mean_j c_j -
  c_i)`` with ``c_i`` the tokens routed to expert ``i`` (the paper's "end of each step"; the
  selection already made does not depend on it, so the step is the same). ``b`` is a buffer
  (``router.bias``, checkpointed). Optional sequence-wise balance loss (``aux_loss_alpha`` =
  α > 0, eqs. 17-20): per sequence of ``T`` tokens ``α Σ_i f_i P_i`` with ``f_i = N/(K T)
  Σ_t 1(s_i,t in TopK(s_t))`` (the paper's top-k of the unbiased affinities) and ``P_i = 1/T
  Σ_t s_i,t / Σ_j s_j,t``, averaged over the batch's sequences (`MoE.aux_loss`; the lab's GPT
  adds it to its training loss).

**Wire format** (the recipe's ``[moe] dispatch``, `fp8lab.recipe.MoEConfig`): the dispatch
all-to-all sends the routed tokens in that format (forward) and the combine's backward sends the
gradients of the expert outputs in it; the combine's forward and the dispatch's backward stay
BF16 (DeepSeek-V3 section 3.3.2; torchao ``moe_training/ep``). Simulated as quantize-dequantize
of the sent tensor (`wire`); the bytes it would put on the wire are counted (`wire_bytes`,
`MoE.last_wire_bytes`). Without a recipe (plain torch experts) nothing is rounded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8lab.nn.grouped import GroupedLinear
from fp8lab.nn.linear import round_high_precision
from fp8lab.nn.saved_activations import swiglu
from fp8lab.qtensor import QuantSpec, quantize
from fp8lab.recipe import Recipe

__all__ = ["ROUTERS", "WIRE_SPECS", "MoE", "Router", "check_experts", "check_router", "wire",
           "wire_bytes"]  # fmt: skip

#: the router scorings: Mixtral's softmax over the top-k logits, DeepSeek-V3's sigmoid
ROUTERS = ("softmax", "sigmoid")
#: DeepSeek-V3's bias update speed γ (0.001 for most of its training)
BIAS_UPDATE_SPEED = 0.001

#: the quantization of each ``[moe] dispatch`` format (None: BF16 rounding)
WIRE_SPECS: dict[str, QuantSpec | None] = {
    "bf16": None,
    # DeepSeek-V3: FP8 E4M3 with one FP32 scale per 1x128 tile (amax/448)
    "fp8": QuantSpec("e4m3", granularity=(1, 128), scaling="max"),
    # torchao a2a_dispatch: triton_to_mxfp8_dim0, 1x32 blocks, RCEIL E8M0 scales
    "mxfp8": QuantSpec("e4m3", granularity="mx", scaling="mx_rceil"),
}

#: bytes of one scale of each wire format's blocks (FP32 tiles, E8M0 MX scales)
_SCALE_BYTES = {"fp8": 4, "mxfp8": 1}


def _send(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` as the receiving rank gets it in wire format ``fmt`` (float32)."""
    spec = WIRE_SPECS[fmt]
    x = x.float().contiguous()
    if spec is None:
        return round_high_precision(x, "bf16")
    return quantize(x, spec).dequantize()


class _Wire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):  # type: ignore[override]
        ctx.bwd = bwd
        return _send(x, fwd)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _send(g, ctx.bwd), None, None


def wire(x: torch.Tensor, forward: str, backward: str) -> torch.Tensor:
    """``x`` sent in format ``forward`` (``bf16``/``fp8``/``mxfp8``, `WIRE_SPECS`), its gradient
    sent back in ``backward``; ``x [rows, hidden]`` float, returned float32."""
    for f in (forward, backward):
        if f not in WIRE_SPECS:
            raise ValueError(f"wire format must be one of {tuple(WIRE_SPECS)}, got {f!r}")
    return _Wire.apply(x, forward, backward)


def wire_bytes(rows: int, hidden: int, fmt: str) -> int:
    """Bytes of ``rows`` tokens of width ``hidden`` in wire format ``fmt``: 2 per element in BF16;
    1 per element plus the scales (one per 1x128 tile in FP32 for ``fp8``, one per 1x32 block
    in E8M0 for ``mxfp8``; a ragged last block has its own scale)."""
    if fmt not in WIRE_SPECS:
        raise ValueError(f"wire format must be one of {tuple(WIRE_SPECS)}, got {fmt!r}")
    spec = WIRE_SPECS[fmt]
    if spec is None:
        return 2 * rows * hidden
    blocks = math.ceil(hidden / spec.block[1])
    return rows * hidden + rows * blocks * _SCALE_BYTES[fmt]


class Router(nn.Module):
    """Top-k gating in fp32 (see the module docstring). ``forward(x [T, C], seq_len=None)`` ->
    ``(gates [T, k] float32, experts [T, k] int64)``; ``seq_len``: tokens per sequence for the
    sequence-wise balance loss (None: all ``T`` one sequence). After a training forward of a
    sigmoid router with ``aux_loss_alpha > 0``, ``aux_loss`` holds that loss (else None)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, router: str = "softmax",
                 bias_update_speed: float = BIAS_UPDATE_SPEED,
                 aux_loss_alpha: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        check_experts(n_experts, top_k)
        check_router(router, bias_update_speed, aux_loss_alpha)
        self.n_experts, self.top_k, self.router = n_experts, top_k, router
        self.bias_update_speed, self.aux_loss_alpha = bias_update_speed, aux_loss_alpha
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        nn.init.normal_(self.weight, 0.0, 0.02)
        if router == "sigmoid":  # only then: a softmax router's state dict stays as it was
            self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        self.aux_loss: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, router={self.router!r}"

    def forward(
        self, x: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.aux_loss = None
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            if self.router == "softmax":
                top, experts = torch.topk(logits, self.top_k, dim=-1)
                return torch.softmax(top, dim=-1), experts
            s = torch.sigmoid(logits)
            experts = torch.topk(s.detach() + self.bias, self.top_k, dim=-1).indices
            w = s.gather(1, experts)
            gates = w / w.sum(dim=-1, keepdim=True)
            if self.training and torch.is_grad_enabled():
                if self.aux_loss_alpha > 0:
                    self.aux_loss = self._balance_loss(s, seq_len or s.shape[0])
                if self.bias_update_speed > 0:
                    self._update_bias(experts)
            return gates, experts

    @torch.no_grad()
    def _update_bias(self, experts: torch.Tensor) -> None:
        load = torch.bincount(experts.reshape(-1), minlength=self.n_experts).float()
        self.bias += self.bias_update_speed * torch.sign(load.mean() - load)

    def _balance_loss(self, s: torch.Tensor, seq_len: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss of affinities ``s [T, N]`` (module doc)."""
        n, k = self.n_experts, self.top_k
        seqs = s.reshape(-1, seq_len, n)  # [B, T, N]
        picked = torch.topk(seqs.detach(), k, dim=-1).indices
        counts = torch.zeros_like(seqs).scatter_(-1, picked, 1.0).sum(dim=1)  # [B, N]
        f = counts * (n / (k * seq_len))
        p = (seqs / seqs.sum(dim=-1, keepdim=True)).mean(dim=1)  # [B, N]
        return self.aux_loss_alpha * (f * p).sum(dim=-1).mean()


def check_router(router: Any, bias_update_speed: Any = BIAS_UPDATE_SPEED,
                 aux_loss_alpha: Any = 0.0, where: str = "model") -> None:  # fmt: skip
    """``ValueError`` naming ``where`` for an unknown router, a negative or non-numeric
    ``bias_update_speed`` or ``aux_loss_alpha``, or either set away from its default with the
    softmax router (they are DeepSeek-V3's sigmoid router's)."""
    if router not in ROUTERS:
        raise ValueError(f"{where}.router must be one of {ROUTERS}, got {router!r}")
    for key, v in (("bias_update_speed", bias_update_speed), ("aux_loss_alpha", aux_loss_alpha)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ValueError(f"{where}.{key} must be a number >= 0, got {v!r}")
    if router == "softmax":
        for key, v, d in (("bias_update_speed", bias_update_speed, BIAS_UPDATE_SPEED),
                          ("aux_loss_alpha", aux_loss_alpha, 0.0)):  # fmt: skip
            if v != d:
                raise ValueError(
                    f"{where}.{key} = {v!r} is DeepSeek-V3's sigmoid router's; set "
                    f"{where}.router = 'sigmoid' (the softmax router has no bias and no "
                    "balance loss)"
                )


def check_experts(n_experts: Any, top_k: Any, where: str = "model") -> None:
    """``ValueError`` naming ``where`` unless 1 <= top_k <= n_experts (integers)."""
    for key, v in (("n_experts", n_experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{where}.{key} must be an integer >= 1, got {v!r}")
    if top_k > n_experts:
        raise ValueError(
            f"{where}.top_k ({top_k}) must be <= {where}.n_experts ({n_experts}): each token "
            "picks top_k distinct experts"
        )


class MoE(nn.Module):
    """Top-k routed SwiGLU experts: ``down(silu(gate(x)) * up(x))`` per expert (see the module
    docstring). ``gate``, ``up`` ``[d_ff, d_model]`` and ``down`` ``[d_model, d_ff]`` are
    `GroupedLinear` of ``n_experts`` experts (``recipe=None``: plain torch experts, converted
    later by `fp8lab.nn.convert`). ``forward(x [..., d_model])`` -> same shape.

    ``router``, ``bias_update_speed``, ``aux_loss_alpha``: the router's scoring and
    DeepSeek-V3's balancing (module docstring); `aux_loss`: the last training forward's balance
    loss (None when there is none).

    After each forward: ``last_tokens`` (tokens routed to each expert), ``last_wire_bytes``
    (``{"dispatch": .., "combine": ..}``, the forward sends) and the experts' padded rows
    (``gate.last_padded_rows``)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        *,
        recipe: Recipe | str | None = None,
        name: str | None = None,
        router: str = "softmax",
        bias_update_speed: float = BIAS_UPDATE_SPEED,
        aux_loss_alpha: float = 0.0,
    ) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts, top_k, router, bias_update_speed, aux_loss_alpha)
        pre = "" if name is None else f"{name}."
        kw: dict[str, Any] = {"recipe": recipe}
        self.gate = GroupedLinear(n_experts, d_model, d_ff, name=name and pre + "gate", **kw)
        self.up = GroupedLinear(n_experts, d_model, d_ff, name=name and pre + "up", **kw)
        self.down = GroupedLinear(n_experts, d_ff, d_model, name=name and pre + "down", **kw)
        self.last_tokens: list[int] = [0] * n_experts
        self.last_wire_bytes: dict[str, int] = {"dispatch": 0, "combine": 0}

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The router's sequence-wise balance loss of the last training forward (or None)."""
        return self.router.aux_loss

    def dispatch_format(self) -> str | None:
        """The recipe's ``[moe] dispatch`` (None: plain torch experts, nothing rounded)."""
        r = self.gate.recipe()
        return None if r is None else r.moe.dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # the sequence-wise balance loss needs the sequences: x [..., seq, d_model]
        gates, experts = self.router(x2, shape[-2] if x.dim() >= 3 else None)
        k = self.router.top_k
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        token = order // k
        sizes = torch.bincount(flat, minlength=self.router.n_experts).tolist()
        self.last_tokens = sizes
        xs = x2[token]
        fmt = self.dispatch_format()
        if fmt is not None:
            xs = wire(xs, fmt, "bf16")
        # under save_activations = "quantized" the product's inputs are saved in FP8
        h = swiglu(self.gate(xs, sizes), self.up(xs, sizes), self.gate.recipe())
        ys = self.down(h, sizes)
        if fmt is not None:
            ys = wire(ys, "bf16", fmt)
        rows, hidden = xs.shape
        self.last_wire_bytes = (
            {"dispatch": 0, "combine": 0}
            if fmt is None
            else {
                "dispatch": wire_bytes(rows, hidden, fmt),
                "combine": wire_bytes(rows, hidden, "bf16"),
            }
        )
        weighted = ys * gates.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        out = torch.zeros(x2.shape[0], ys.shape[1], dtype=ys.dtype, device=ys.device)
        out = out.index_add(0, token, weighted)
        return out.reshape(*shape[:-1], ys.shape[1]).to(x.dtype)
