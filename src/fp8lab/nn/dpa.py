"""`DotProductAttention`: attention with Transformer Engine's FP8 quantization points.

``softmax(q kᵀ * softmax_scale + mask) v`` for ``q [B, H, Sq, D]``, ``k, v [B, Hkv, Skv, D]``
(grouped-query attention: ``H`` a multiple of ``Hkv``), in fp32 when the recipe in force does not
set ``attention`` (TE's ``fp8_dpa`` off) or quantizes no role (``fp32``, ``bf16``), else with
the recipe's ``[dpa]`` options
(`fp8lab.recipe.DPAConfig`, docs/attention.md).

TE's path (``path = "te"``, TE ``FusedAttnFunc`` over cuDNN's FP8 SDPA graphs; the quantizer
slots of ``dot_product_attention/utils.py::get_attention_quantizers``): six quantizers, and the
roles every record names (``gemm = "dpa"`` in `fp8lab.nn.on_operand` and `fp8lab.watch`):

* ``QKV`` quantizes Q, K and V together (one per-tensor scale for the three, TE
  ``combine_and_quantize``; MXFP8: each alone, 1x32 blocks along the dimension each GEMM
  reduces) -- roles ``Q``, ``K``, ``V``;
* ``S`` the softmax output ``P = exp(logits - logsumexp)`` (E4M3, forward format) -- role ``S``;
* ``O`` the output: quantized under delayed scaling (the kernel writes FP8) and with ``fp8_mha``
  -- role ``O``;
* ``dO`` the incoming gradient (backward format) -- role ``dO``;
* ``dP``: the gradient of the scores, ``dS = P * (dO Vᵀ - rowsum(dO * O)) * softmax_scale``
  (cudnn-frontend ``sdpa_fp8_bwd.h`` takes ``amax_dP`` and applies ``scale_dP`` after the softmax
  backward) -- role ``dP``;
* ``dQKV``: dQ, dK and dV together, quantized under delayed scaling (the kernel writes FP8) and
  with ``fp8_mha`` -- role ``dQKV``.

The GEMMs multiply the dequantized operands in fp32 (torch's BLAS), the softmax and logsumexp
are exact fp32. Scalings (``NVTE_DPA_FP8_RECIPE``): ``delayed`` (all six delayed), ``current``
(QKV, O, dO, dQKV current; S and dP delayed, TE's choice), ``mxfp8`` (QKV, O, dO, dQKV in MX
blocks; S and dP per-tensor current scaling, an assumption: TE's fused kernel handles them
inside). Delayed states update on TE's timing (forward slots after the forward or at the outermost
`fp8lab.nn.autocast` exit, not under ``no_grad``; backward slots at the end of the backward) and
live in the module's ``state_dict`` (``fp8_dpa_recipe``, ``fp8_dpa_<slot>_<field>``).

The FlashAttention-3 style path (``path = "fa"``, forward only): Q, K, V as above; the
unnormalised ``exp(logits - rowmax)`` cast to E4M3 after multiplying by ``2**p_prescale_log2``
and nothing else; the row sums and logsumexp in exact fp32; ``O = (P8 V) / rowsum``. Its
backward is the fp32 attention backward (FP8 backward attention is TE's path only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fp8lab.nn.context as _context
from fp8lab.nn.linear import _OBSERVERS
from fp8lab.qtensor import QTensor, QuantSpec, quantize
from fp8lab.recipe import Recipe, get_recipe
from fp8lab.scaling.delayed import DelayedScaling, DelayedScalingConfig

__all__ = [
    "DPA_GEMM",
    "DPA_ROLES",
    "DPA_SLOTS",
    "DPAPlan",
    "DotProductAttention",
    "check_head_dim",
    "dpa_plan",
]

#: the `on_operand` / watch ``gemm`` name of attention's quantization points
DPA_GEMM = "dpa"
#: TE's DPA roles, in the order they are quantized
DPA_ROLES = ("Q", "K", "V", "S", "O", "dO", "dP", "dQKV")
#: TE's quantizer slots (``META_QKV``, ``META_S``, ``META_O``; ``META_DO``, ``META_DP``,
#: ``META_DQKV``): forward ones, then backward ones
DPA_SLOTS = ("QKV", "S", "O", "dO", "dP", "dQKV")
_FORWARD_SLOTS = ("QKV", "S", "O")
#: MXFP8 block length (TE, cuDNN): head dims must be multiples of it
MX_BLOCK = 32
_STATE_PREFIX = "fp8_dpa_"
_RECIPE_KEY = "fp8_dpa_recipe"
_FP8 = ("e4m3", "e5m2")


@dataclass(frozen=True)
class DPAPlan:
    """A recipe's attention resolved: the scaling mode, each slot's `QuantSpec` (delayed slots
    hold a `DelayedScalingConfig`), the path and its offset, ``fp8_mha``."""

    scaling: str
    path: str
    fp8_mha: bool
    p_prescale_log2: int
    specs: dict[str, QuantSpec]

    @property
    def quantizes_output(self) -> bool:
        """Whether O (and dQKV) leave in FP8: delayed scaling (cuDNN writes FP8) or fp8_mha."""
        return self.scaling == "delayed" or self.fp8_mha

    @property
    def delayed_slots(self) -> tuple[str, ...]:
        return tuple(s for s in DPA_SLOTS if self.specs[s].is_delayed)


def _formats(recipe: Recipe) -> tuple[str, str]:
    """TE's fp8_format of the autocast recipe: forward (input's) and backward (grad_output's)
    formats when they are FP8, else HYBRID (E4M3, E5M2)."""
    fwd = recipe.input.format if recipe.input is not None else "e4m3"
    bwd = recipe.grad_output.format if recipe.grad_output is not None else "e5m2"
    return (fwd if fwd in _FP8 else "e4m3"), (bwd if bwd in _FP8 else "e5m2")


def _resolve_scaling(recipe: Recipe) -> str:
    """``[dpa] scaling``, with ``auto`` as TE follows the autocast recipe."""
    s = recipe.dpa.scaling
    if s != "auto":
        return s
    spec = recipe.input
    if spec is not None and spec.is_delayed:
        return "delayed"
    if spec is not None and spec.block in ((1, 32), (32, 1)):
        return "mxfp8"
    return "current"


def dpa_plan(recipe: Recipe) -> DPAPlan:
    """The attention plan of ``recipe`` (whose ``attention`` is on)."""
    cfg = recipe.dpa
    mode = _resolve_scaling(recipe)
    fwd, bwd = _formats(recipe)
    own = recipe.input.scaling if recipe.input is not None and recipe.input.is_delayed else None
    # a delayed recipe's own configuration, else TE's NVTE_DPA_FP8DS_* (defaults 1, most_recent)
    delayed = own or DelayedScalingConfig(
        history_len=cfg.amax_history_len, algorithm=cfg.amax_compute_algo
    )

    def spec(fmt: str, kind: str) -> QuantSpec:
        if kind == "delayed":
            return QuantSpec(format=fmt, granularity="tensor", scaling=delayed)
        if kind == "mx":
            return QuantSpec(format=fmt, granularity="mx", scaling="mx_rceil")
        return QuantSpec(format=fmt, granularity="tensor", scaling="max")

    main = {"delayed": "delayed", "current": "current", "mxfp8": "mx"}[mode]
    inner = {"delayed": "delayed", "current": "delayed", "mxfp8": "current"}[mode]
    specs = {
        "QKV": spec(fwd, main),
        "S": spec(fwd, inner),
        "O": spec(fwd, main),
        "dO": spec(bwd, main),
        "dP": spec(bwd, inner),
        "dQKV": spec(bwd, main),
    }
    return DPAPlan(mode, cfg.path, cfg.fp8_mha, cfg.p_prescale_log2, specs)


def check_head_dim(recipe: Recipe | None, head_dim: int, where: str = "attention") -> None:
    """ValueError when ``recipe`` runs attention in MXFP8 and ``head_dim`` is not a multiple of
    the 32-element block (TE and cuDNN require ``d % 32 == 0``)."""
    if recipe is None or not recipe.attention or recipe.input is None:
        return  # no FP8 attention
    if _resolve_scaling(recipe) == "mxfp8" and head_dim % MX_BLOCK:
        raise ValueError(
            f"{where}: head size {head_dim} does not tile the MXFP8 block of {MX_BLOCK} "
            f"(recipe {recipe.name!r}, [dpa] scaling = mxfp8); use a head size that is a "
            f"multiple of {MX_BLOCK}"
        )


# =========================================================================== quantizing
def _emit(layer: str, role: str, source: torch.Tensor, used: QTensor) -> None:
    for fn in list(_OBSERVERS.active):
        fn(layer, DPA_GEMM, role, source, used)


def _joint(
    ts: list[torch.Tensor], spec: QuantSpec, state: DelayedScaling | None
) -> tuple[QTensor, list[QTensor]]:
    """``ts`` quantized as one tensor (TE ``combine_and_quantize``): per-tensor, the flattened
    tensors with one scale for all; MX, their rows stacked (blocks along the last dimension, so
    each row is quantized as in its own tensor). Returns the whole and each tensor's piece."""
    per_tensor = spec.block == (-1, -1)
    flat = [t.reshape(-1) if per_tensor else t.reshape(-1, t.shape[-1]) for t in ts]
    whole = quantize(torch.cat(flat), spec, state=state)
    parts, at = [], 0
    for t, f in zip(ts, flat, strict=True):
        n = f.shape[0]
        rows = slice(None) if per_tensor else slice(at, at + n)
        sm = whole.scale_multipliers
        parts.append(QTensor(values=whole.values[at : at + n].view(t.shape),
                             scales=whole.scales[rows], spec=whole.spec,
                             scale_multipliers=None if sm is None else sm[rows]))  # fmt: skip
        at += n
    return whole, parts


def _columnwise(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``t [..., S, D]`` quantized in blocks along S (the GEMM reduces over S), dequantized."""
    return quantize(t.transpose(-1, -2).contiguous(), spec).dequantize().transpose(-1, -2)


def _causal_mask(sq: int, skv: int, device: torch.device) -> torch.Tensor:
    """True where key j is masked for query i (top-left aligned: j > i), as torch's SDPA."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).triu(1)


# =========================================================================== TE's path
class _Ctx:
    """What one attention call needs: plan, states, layer name, scale, mask."""

    def __init__(self, plan: DPAPlan, states: dict[str, DelayedScaling], layer: str,
                 scale: float, mask: torch.Tensor | None) -> None:  # fmt: skip
        self.plan, self.states, self.layer, self.scale, self.mask = plan, states, layer, scale, mask

    def q(self, slot: str, x: torch.Tensor) -> QTensor:
        return quantize(x.contiguous(), self.plan.specs[slot], state=self.states.get(slot))


def _logits(qd: torch.Tensor, kd: torch.Tensor, c: _Ctx) -> torch.Tensor:
    s = torch.matmul(qd, kd.transpose(-1, -2)) * c.scale
    return s if c.mask is None else s.masked_fill(c.mask, float("-inf"))


def _quantize_qkv(q, k, v, c: _Ctx) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    """The QKV slot: dequantized Q, K, V for the forward GEMMs (Q, K along D; MXFP8 V along S),
    plus, under MXFP8, the backward's other orientations (Q, K along S; V along D)."""
    spec = c.plan.specs["QKV"]
    mx = spec.block != (-1, -1)
    if mx:
        _, (qq, kq) = _joint([q, k], spec, None)
        vq = quantize(v.transpose(-1, -2).contiguous(), spec)
        parts = {"Q": (q, qq), "K": (k, kq), "V": (v.transpose(-1, -2), vq)}
    else:
        _, (qq, kq, vq) = _joint([q, k, v], spec, c.states.get("QKV"))
        parts = {"Q": (q, qq), "K": (k, kq), "V": (v, vq)}
    for role, (src, used) in parts.items():
        _emit(c.layer, role, src, used)
    qd, kd = qq.dequantize(), kq.dequantize()
    if not mx:
        vd = vq.dequantize()
        return qd, kd, vd, qd, kd, vd
    vd = vq.dequantize().transpose(-1, -2)
    # backward copies, quantized independently from the high-precision tensors (TE MXFP8)
    return qd, kd, vd, _columnwise(q, spec), _columnwise(k, spec), quantize(v, spec).dequantize()


class _TEAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c: _Ctx):  # type: ignore[override]
        qd, kd, vd, q_bwd, k_bwd, v_bwd = _quantize_qkv(q, k, v, c)
        logits = _logits(qd, kd, c)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        p = torch.exp(logits - _finite(lse))  # a fully masked row: P = 0
        sq = c.q("S", p)
        _emit(c.layer, "S", p, sq)
        sd = sq.dequantize()
        o = torch.matmul(sd, vd)
        if c.plan.quantizes_output:
            oq = c.q("O", o)
            _emit(c.layer, "O", o, oq)
            out = oq.dequantize()
        else:
            out = o
        # cuDNN's backward computes rowsum(dO * O) from the FP8 O under delayed scaling, from the
        # high-precision O otherwise (TE: NVTE_DPA_FP8CS_O_in_F16, MXFP8's dO_f16 and O)
        o_for_d = out if c.plan.scaling == "delayed" else o
        ctx.save_for_backward(p, sd, o_for_d, q_bwd, k_bwd, v_bwd)
        ctx.c = c
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        p, sd, o_for_d, q_bwd, k_bwd, v_bwd = ctx.saved_tensors
        c: _Ctx = ctx.c
        plan = c.plan
        mx = plan.specs["dO"].block != (-1, -1)
        g = g.contiguous()
        dq_ = c.q("dO", g)
        _emit(c.layer, "dO", g, dq_)
        dod = dq_.dequantize()
        do_cols = _columnwise(g, plan.specs["dO"]) if mx else dod
        dv = torch.matmul(sd.transpose(-1, -2), do_cols)
        dp_raw = torch.matmul(dod, v_bwd.transpose(-1, -2))
        do_for_d = dod if plan.scaling == "delayed" else g
        d = (do_for_d * o_for_d).sum(dim=-1, keepdim=True)
        ds = p * (dp_raw - d) * c.scale
        dsq = c.q("dP", ds)
        _emit(c.layer, "dP", ds, dsq)
        dsd = dsq.dequantize()
        dq = torch.matmul(dsd, k_bwd)
        dk = torch.matmul(dsd.transpose(-1, -2), q_bwd)
        if plan.quantizes_output:
            spec = plan.specs["dQKV"]
            whole, parts = _joint([dq, dk, dv], spec, c.states.get("dQKV"))
            if _OBSERVERS.active:
                flat = [t.reshape(-1) if spec.block == (-1, -1) else t.reshape(-1, t.shape[-1])
                        for t in (dq, dk, dv)]  # fmt: skip
                _emit(c.layer, "dQKV", torch.cat(flat), whole)
            dq, dk, dv = (t.dequantize() for t in parts)
        for slot in ("dO", "dP", "dQKV"):
            ds_ = c.states.get(slot)
            if ds_ is not None:
                ds_.update()
        return dq, dk, dv, None


# =========================================================================== FA-3 style path
def _fa_forward(q, k, v, c: _Ctx) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """FlashAttention-3's FP8 forward: P = exp(logits - rowmax) * 2**offset cast to E4M3 (no
    other scale), O = (P8 V) * 2**-offset / rowsum with rowsum and logsumexp exact."""
    qd, kd, vd, *_ = _quantize_qkv(q, k, v, c)
    logits = _logits(qd, kd, c)
    m = logits.amax(dim=-1, keepdim=True)
    e = torch.exp(logits - _finite(m))
    rowsum = e.sum(dim=-1, keepdim=True)
    offset = float(2.0**c.plan.p_prescale_log2)
    fmt = c.plan.specs["S"].format
    pq = quantize(e, QuantSpec(format=fmt, granularity="tensor", scaling=offset))
    _emit(c.layer, "S", e, pq)
    return torch.matmul(pq.dequantize(), vd) / rowsum.clamp_min(torch.finfo(torch.float32).tiny)


class _FAAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c: _Ctx):  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        ctx.c = c
        return _fa_forward(q, k, v, c)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        c: _Ctx = ctx.c
        with torch.enable_grad():
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            out = _plain(qs, ks, vs, c.scale, c.mask)
            return (*torch.autograd.grad(out, (qs, ks, vs), g), None)


def _plain(q, k, v, scale: float, mask: torch.Tensor | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - _finite(lse)), v)


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with -inf (the row max or logsumexp of a fully masked row) replaced by 0."""
    return torch.where(torch.isneginf(t), torch.zeros_like(t), t)


# =========================================================================== the module
class DotProductAttention(nn.Module):
    """Attention with TE's FP8 quantization points (module docstring).

    Args:
        recipe: the module's own recipe (a `Recipe` or preset name), or ``None``: the
            :func:`fp8lab.nn.autocast` recipe in force (none: plain fp32 attention). A recipe
            passed to `forward` wins over both.
        softmax_scale: multiplies ``q kᵀ`` (default ``1/sqrt(head_dim)``).
        name: the layer name in records (`fp8lab.watch`); the lab's GPT names its modules.
    """

    def __init__(self, recipe: Recipe | str | None = None, *, softmax_scale: float | None = None,
                 name: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        self.softmax_scale = softmax_scale
        self.name = name
        #: per recipe fingerprint: (plan, delayed states by slot)
        self._plans: dict[str, tuple[DPAPlan, dict[str, DelayedScaling]]] = {}
        self._last: str | None = None  # fingerprint of the last FP8 recipe run (saved)
        self._pending: dict[str, torch.Tensor] = {}  # state loaded before that recipe ran

    def extra_repr(self) -> str:
        return f"recipe={self.recipe.name if self.recipe is not None else None!r}"

    # ------------------------------------------------------------------ state
    def _bind(self, recipe: Recipe, device: torch.device) -> tuple[DPAPlan, dict[str, Any]]:
        fp = recipe.fingerprint()
        hit = self._plans.get(fp)
        if hit is None:
            plan = dpa_plan(recipe)
            states = {}
            # the FA path quantizes only QKV with a state (P has its fixed offset)
            slots = plan.delayed_slots if plan.path == "te" else ("QKV",)
            for slot in (s for s in slots if s in plan.delayed_slots):
                spec = plan.specs[slot]
                states[slot] = DelayedScaling.bind(spec.scaling, spec.format, device=device)
            hit = self._plans[fp] = (plan, states)
            if self._pending:
                self._restore(fp, states)
        self._last = fp
        return hit

    def _restore(self, fp: str, states: dict[str, DelayedScaling]) -> None:
        pending, self._pending = self._pending, {}
        where = self.name or "DotProductAttention"
        saved = bytes(pending.pop(_RECIPE_KEY).to(torch.uint8).tolist()).decode()
        if saved != fp:
            raise ValueError(f"{where}: attention state was saved under another recipe")
        for slot, ds in states.items():
            fields = ds.state_dict()
            try:
                new = {f: pending.pop(f"{_STATE_PREFIX}{slot}_{f}") for f in fields}
            except KeyError as exc:
                raise ValueError(f"{where}: mismatched attention state, missing {exc}") from None
            ds.load_state_dict(new)
        if pending:
            raise ValueError(f"{where}: mismatched attention state, unexpected {sorted(pending)}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._pending:  # loaded, not yet run: saved back as it came
            for k, t in self._pending.items():
                destination[prefix + k] = t
            return
        if self._last is None or not self._plans[self._last][1]:
            return  # no delayed state: no keys (models without FP8 attention save as before)
        destination[prefix + _RECIPE_KEY] = torch.tensor(list(self._last.encode()),
                                                         dtype=torch.uint8)  # fmt: skip
        for slot, ds in self._plans[self._last][1].items():
            for f, t in ds.state_dict().items():
                destination[f"{prefix}{_STATE_PREFIX}{slot}_{f}"] = t

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        ours = {k[len(prefix) :]: v for k, v in state_dict.items()
                if k.startswith(prefix + _STATE_PREFIX)}  # fmt: skip
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        unexpected_keys[:] = [k for k in unexpected_keys if k[len(prefix) :] not in ours]
        if not ours:
            return
        if _RECIPE_KEY not in ours:
            raise ValueError(f"{self.name or prefix}: attention state without {_RECIPE_KEY}")
        self._pending = {k: v.detach().clone() for k, v in ours.items()}
        fp = bytes(ours[_RECIPE_KEY].to(torch.uint8).tolist()).decode()
        if fp in self._plans:  # that recipe already ran here: load now
            self._restore(fp, self._plans[fp][1])

    def update_forward(self) -> None:
        """Update the forward slots' delayed scaling (QKV, S, O) of every recipe run."""
        for _, states in self._plans.values():
            for slot in _FORWARD_SLOTS:
                if slot in states:
                    states[slot].update()

    def discard_forward(self) -> None:
        """Forget the forward slots' staged amaxes (evaluation must not move the scales)."""
        for _, states in self._plans.values():
            for slot in _FORWARD_SLOTS:
                ds = states.get(slot)
                if ds is not None and ds.measuring:
                    ds.stage(0.0)

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                is_causal: bool = False, attn_mask: torch.Tensor | None = None,
                recipe: Recipe | None = None) -> torch.Tensor:  # fmt: skip
        """``q [B, H, Sq, D]``, ``k, v [B, Hkv, Skv, D]`` (float) -> ``[B, H, Sq, D]`` float32.
        ``is_causal``: key j masked for query i when ``j > i`` (top-left, as torch's SDPA);
        ``attn_mask``: a bool mask broadcastable to ``[B, H, Sq, Skv]``, True where a query may
        attend (torch's SDPA convention); a query that may attend to nothing gets zeros."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("DotProductAttention: q, k, v must be [batch, heads, seq, head_dim]")
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head serves a group
            if q.shape[1] % k.shape[1]:
                raise ValueError(
                    f"DotProductAttention: {q.shape[1]} query heads are not a multiple of "
                    f"{k.shape[1]} key/value heads"
                )
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        rec = recipe if recipe is not None else _context.active_recipe(self.recipe)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        mask = _causal_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else None
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise TypeError(f"attn_mask must be a bool tensor, got {attn_mask.dtype}")
            mask = ~attn_mask if mask is None else mask | ~attn_mask
        q32, k32, v32 = (t.float() for t in (q, k, v))
        if rec is None or not rec.attention or rec.input is None:
            # no FP8 attention asked, or a recipe without quantized roles (fp32, bf16)
            return _plain(q32, k32, v32, scale, mask)
        where = self.name or "DotProductAttention"
        check_head_dim(rec, q.shape[-1], where)
        check_head_dim(rec, v.shape[-1], where)
        plan, states = self._bind(rec, q.device)
        c = _Ctx(plan, states, where, scale, mask)
        fn = _TEAttention if plan.path == "te" else _FAAttention
        out = fn.apply(q32, k32, v32, c)
        if states:
            grad = torch.is_grad_enabled()
            if _context.in_autocast():
                _context.defer_forward_update(self)
            elif grad:
                self.update_forward()
            else:
                self.discard_forward()
        return out
