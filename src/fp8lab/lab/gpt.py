"""A small GPT for the training lab, written to be read in one sitting (after nanoGPT's model.py).

Pre-norm transformer: token embedding ``tok_emb`` -> ``n_layer`` blocks of (RMSNorm -> causal
self-attention -> residual add, RMSNorm -> SwiGLU MLP -> residual add) -> final RMSNorm -> untied
output head ``lm_head``. Positions use learned embeddings ``pos_emb``. Byte-level tokens: the
vocabulary is the 256 byte values. Every projection is a bias-free ``torch.nn.Linear`` so that
``fp8lab.nn.convert`` can swap it for a quantized one; the names are

    blocks.{i}.attn.qkv    [3*d_model, d_model]   fused query/key/value projection
    blocks.{i}.attn.proj   [d_model, d_model]     attention output projection
    blocks.{i}.mlp.gate    [d_ff, d_model]        SwiGLU gate   (silu branch)
    blocks.{i}.mlp.up      [d_ff, d_model]        SwiGLU linear branch
    blocks.{i}.mlp.down    [d_model, d_ff]        SwiGLU down projection
    lm_head                [vocab_size, d_model]  output head (kept high precision by convert())

With ``n_experts > 1`` each block's MLP is a mixture of experts (`fp8lab.nn.MoE`, docs/moe.md):
an fp32 router ``blocks.{i}.mlp.router.weight [n_experts, d_model]`` sends each token to its
``top_k`` experts, each a SwiGLU of the sizes above (``blocks.{i}.mlp.gate.experts.{e}``, ``up``
and ``down`` alike, `fp8lab.nn.GroupedLinear`), tokens dispatched in the recipe's ``[moe]
dispatch`` format. ``n_experts = 1`` (the default) is the dense MLP, no router. ``router =
"sigmoid"`` is DeepSeek-V3's router (its selection bias ``blocks.{i}.mlp.router.bias``, moved by
``bias_update_speed`` each step; ``aux_loss_alpha > 0`` adds its sequence-wise balance loss to
the training loss); ``"softmax"`` (the default) is Mixtral's.

Attention runs in ``F.scaled_dot_product_attention``, except when the recipe the block's ``qkv``
projection runs under (the one ``convert`` gave it, or an ``fp8lab.nn.autocast`` override) sets
``attention=True``: then it runs in the block's ``fp8lab.nn.DotProductAttention``
(``blocks.{i}.attn.dpa``: TE's FP8 quantization points Q, K, V, S, O, dO, dP, dQKV under the
recipe's ``[dpa]`` options, its delayed-scaling state in the model's ``state_dict``).

Default sizes (2 layers, d_model 256, d_ff 768, 4 heads, context 128; 1.9 M parameters) are
what ``make demo`` trains. Every GEMM dimension is a multiple of 128 and larger than 128, so
128x128 weight blocks and 1x128 activation tiles hold several blocks per tensor and really
differ from one per-tensor scale (with d_model 128, a 1x128 tile of the qkv input would be a
whole row, i.e. rowwise scaling, and ``attn.proj``'s 128x128 weight a single block).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from fp8lab.nn import DotProductAttention, GroupedLinear, MoE
from fp8lab.nn.dpa import check_head_dim
from fp8lab.nn.moe import BIAS_UPDATE_SPEED, check_experts, check_router
from fp8lab.nn.saved_activations import layer_recipe, save_quantized, saves_quantized, swiglu
from fp8lab.recipe import Recipe


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes. ``vocab_size`` 256 = byte-level tokens."""

    vocab_size: int = 256
    block_size: int = 128  # context length in tokens
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 256
    d_ff: int = (
        768  # SwiGLU hidden width (3 * d_model keeps params ~ a 4x GELU MLP... close enough)
    )
    norm_eps: float = 1e-6
    init_std: float = 0.02
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm" (weight and bias)
    mlp: str = "swiglu"  # "swiglu" | "smooth_swiglu" (fp8lab.nn.SmoothSwiGLU)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before q kᵀ
    n_experts: int = 1  # > 1: a mixture-of-experts MLP (fp8lab.nn.MoE)
    top_k: int = 1  # experts per token (<= n_experts)
    router: str = "softmax"  # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3, with its balancing)
    bias_update_speed: float = BIAS_UPDATE_SPEED  # sigmoid router: the bias step γ per step
    aux_loss_alpha: float = 0.0  # sigmoid router: the sequence-wise balance loss weight α

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in OPTIONS:
                _check_option(f.name, value)
            elif f.name in _ROUTER_KEYS:
                continue  # check_router below
            elif f.name in ("norm_eps", "init_std"):
                if not (isinstance(value, int | float) and value > 0):
                    raise ValueError(f"GPTConfig.{f.name} must be > 0, got {value!r}")
            elif not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"GPTConfig.{f.name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        check_experts(self.n_experts, self.top_k)
        check_router(self.router, self.bias_update_speed, self.aux_loss_alpha)
        if self.n_experts == 1 and self.router != "softmax":
            raise ValueError(
                f"GPTConfig: router = {self.router!r} routes tokens to experts; the dense MLP "
                "(n_experts = 1) has no router (set n_experts > 1)"
            )
        if self.n_experts > 1 and self.mlp != "swiglu":
            raise ValueError(
                f"GPTConfig: n_experts = {self.n_experts} builds SwiGLU experts; mlp = "
                f"{self.mlp!r} is a dense MLP option (use mlp = 'swiglu' with experts)"
            )

    def to_dict(self) -> dict:
        return without_default_options(asdict(self))


#: the model options and their defaults; absent from ``to_dict`` at the default, so the
#: configuration (and every run directory written before them) stays what it was
OPTIONS: dict[str, tuple[object, tuple[object, ...]]] = {
    "norm": ("rmsnorm", ("rmsnorm", "layernorm")),
    "mlp": ("swiglu", ("swiglu", "smooth_swiglu")),
    "qk_norm": (False, (False, True)),
}


def _check_option(name: str, value: object) -> None:
    default, valid = OPTIONS[name]
    if type(value) is not type(default) or value not in valid:
        shown = ", ".join(str(v).lower() if isinstance(v, bool) else repr(v) for v in valid)
        raise ValueError(f"GPTConfig.{name} must be one of {shown}, got {value!r}")


#: the mixture-of-experts sizes and their defaults (``n_experts = 1``: the dense MLP, no
#: router); absent from ``to_dict`` at the default too
MOE_DEFAULTS = {"n_experts": 1, "top_k": 1, "router": "softmax",
                "bias_update_speed": BIAS_UPDATE_SPEED, "aux_loss_alpha": 0.0}  # fmt: skip
_ROUTER_KEYS = ("router", "bias_update_speed", "aux_loss_alpha")


def without_default_options(d: dict) -> dict:
    """``d`` (a model config's plain data) without the options (:data:`OPTIONS`) and the
    mixture-of-experts sizes (:data:`MOE_DEFAULTS`) at their defaults."""
    defaults = {**{k: v[0] for k, v in OPTIONS.items()}, **MOE_DEFAULTS}
    return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}


def norm_affine(p: torch.Tensor | None, recipe: Recipe | None) -> torch.Tensor | None:
    """A norm's affine parameter as the layer it feeds uses it: quantized with that layer's
    ``weight`` spec (a ``[1, dim]`` row, straight-through gradient) when its recipe sets
    ``norm_weights = "quantized"`` (Su et al., arXiv 2506.20752: MX-quantized LayerNorm
    affine parameters), else as it is."""
    if p is None or recipe is None or recipe.norm_weights != "quantized" or recipe.weight is None:
        return p
    from fp8lab.qtensor import fake_quant

    return fake_quant(p.reshape(1, -1), recipe.weight).reshape(p.shape)


def check_attention_recipe(cfg: GPTConfig, recipe: Recipe | None) -> None:
    """ValueError, before any training, when a block's recipe (its ``qkv`` projection's, with
    ``[[layer]]`` rules applied) runs FP8 attention in blocks that its head size does not tile
    (MXFP8: ``d_model / n_head`` a multiple of 32)."""
    if recipe is None:
        return
    head = cfg.d_model // cfg.n_head
    for i in range(cfg.n_layer):
        where = f"model (d_model {cfg.d_model} / n_head {cfg.n_head}), blocks.{i}.attn"
        check_head_dim(recipe.for_layer(f"blocks.{i}.attn.qkv"), head, where)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight (no bias, no mean subtraction). ``forward(x, recipe)``: the
    recipe of the layer the norm feeds (its ``norm_weights``, its ``save_activations``);
    ``affine=False``: the recipe decides only what is saved (a norm that feeds no quantized
    Linear: the q/k norms, the final norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, recipe: Recipe | None = None, affine: bool = True
    ) -> torch.Tensor:
        w = norm_affine(self.weight, recipe) if affine else self.weight
        if saves_quantized(recipe):
            return save_quantized(lambda x, w: _rms_norm(x, w, self.eps), (x,), (w,))
        return _rms_norm(x, w, self.eps)


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias (``--set model.norm=layernorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(
        self, x: torch.Tensor, recipe: Recipe | None = None, affine: bool = True
    ) -> torch.Tensor:
        w, b = self.weight, self.bias
        if affine:  # as RMSNorm
            w, b = norm_affine(w, recipe), norm_affine(b, recipe)
        if saves_quantized(recipe):
            fn = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, self.eps)  # noqa: E731
            return save_quantized(fn, (x,), (w, b))
        return F.layer_norm(x, x.shape[-1:], w, b, self.eps)


def make_norm(cfg: GPTConfig, dim: int | None = None) -> nn.Module:
    """The configured norm over ``dim`` features (default ``d_model``)."""
    cls = LayerNorm if cfg.norm == "layernorm" else RMSNorm
    return cls(cfg.d_model if dim is None else dim, cfg.norm_eps)


def recipe_of(layer: nn.Module) -> Recipe | None:
    """The recipe a (converted) projection runs under: the one ``convert`` gave it, or an
    ``fp8lab.nn.autocast`` override, with its ``[[layer]]`` rules resolved (None: a plain
    torch layer)."""
    if isinstance(layer, GroupedLinear):  # a mixture of experts: its experts' recipe
        return layer.recipe()
    return layer_recipe(layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        if cfg.qk_norm:  # Dehghani et al. 2023 (arXiv 2302.05442): bounds the logits q kᵀ
            self.q_norm = RMSNorm(cfg.d_model // cfg.n_head, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.d_model // cfg.n_head, cfg.norm_eps)
        self.dpa = DotProductAttention()  # FP8 attention when the block's recipe asks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        recipe = self._recipe()
        if hasattr(self, "q_norm"):  # their inputs saved in FP8 as the recipe says
            q, k = self.q_norm(q, recipe, affine=False), self.k_norm(k, recipe, affine=False)
        if recipe is not None and recipe.attention:
            y = self.dpa(q, k, v, is_causal=True, recipe=recipe)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)

    def _recipe(self) -> Recipe | None:
        """The recipe the block's projections run under (None: plain torch layers)."""
        # an autocast recipe with [[layer]] rules: the rules of this block's qkv projection
        return recipe_of(self.qkv)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu's input and the product's factor saved in FP8 as the recipe says
        return self.down(swiglu(self.gate(x), self.up(x), recipe_of(self.gate)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = _mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a norm's affine parameters as the projection after it runs (recipe.norm_weights)
        x = x + self.attn(self.attn_norm(x, recipe_of(self.attn.qkv)))
        return x + self.mlp(self.mlp_norm(x, recipe_of(self.mlp.gate)))


def _mlp(cfg: GPTConfig) -> nn.Module:
    if cfg.n_experts > 1:
        return MoE(
            cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, router=cfg.router,
            bias_update_speed=cfg.bias_update_speed, aux_loss_alpha=cfg.aux_loss_alpha,
        )  # fmt: skip
    if cfg.mlp == "smooth_swiglu":
        from fp8lab.nn import SmoothSwiGLU

        return SmoothSwiGLU(cfg.d_model, cfg.d_ff)
    return SwiGLU(cfg)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg)  # lm_head stays high precision: so do these parameters
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, m in self.named_modules():  # the attention's layer name in watch records
            if isinstance(m, DotProductAttention):
                m.name = name
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std) everywhere, residual output projections scaled by
        1/sqrt(2 * n_layer); RMSNorm weights 1. Uses the global torch RNG (seed it first)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")) or ".mlp.down." in name:
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                p.normal_(0.0, std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: [B, T] int64 token ids -> (logits [B, T, vocab], mean cross-entropy or None)."""
        seq_len = idx.shape[1]
        if seq_len > self.cfg.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(seq_len, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        # save_activations is a whole-model key: the last block's recipe says it for this norm
        logits = self.lm_head(self.norm(x, recipe_of(self.blocks[-1].attn.qkv), affine=False))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
            # DeepSeek-V3's sequence-wise balance loss of each MoE block, when it has one
            for block in self.blocks:
                aux = getattr(block.mlp, "aux_loss", None)
                if aux is not None:
                    loss = loss + aux
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, generator=None
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` bytes after ``idx`` [B, T]."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
