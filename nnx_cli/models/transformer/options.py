"""The `model` options of `transformer_lm`, checked and resolved into an :class:`Architecture`.

Every part of the model (attention, MLP, norms, block) is built from one
`Architecture`: a frozen, hashable record of what shapes a block's function,
so that it can live in the ModuleDef. :func:`architecture` checks the raw
options (a ValueError names the `model.` key) and fills in what they imply
(`head_dim` from `embed_dim / num_heads`, `num_kv_heads` from `num_heads`,
the residual projections' initial std from the depth)::

    arch = architecture(**options)       # the TransformerLM keywords that shape a block
    arch.kv_axis                         # "kv_heads" under grouped-query attention
    arch.adapter("q")                    # the LoRA settings of the query projection, or None

A new kind of norm, MLP or position goes into the tuple of its option here
(:data:`NORMS`, :data:`MLPS`, :data:`POSITIONS`) and into the module that
builds it; a new option into :class:`Architecture` and :func:`architecture`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from nnx_cli.models.layers import check_rate, check_sizes
from nnx_cli.models.transformer.rotary import check_rope_scaling

POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm", "gemma_rmsnorm")
MLPS = ("gelu", "swiglu", "geglu")
LAYER_TYPES = ("full_attention", "sliding_attention")
GATED = ("swiglu", "geglu")  # MLPs with a gate projection
REMATS = ("none", "full", "dots")
QK_NORM_SCOPES = ("head", "projection")  # each head's queries (Qwen3), or a projection's all heads at once (OLMoE)
ATTENTIONS = ("auto", "core", "xla", "cudnn")  # how attention runs (attention.choose_attention)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# LoRA
# ------------------------------------------------------------------------------


PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "out", "gate": "gate", "up": "fc", "down": "proj"}
"""The projections LoRA can adapt, by the short names `model.lora.targets` uses, and their module names here."""

EXPERT_PROJECTIONS = {"expert_gate": "gate", "expert_up": "fc", "expert_down": "proj"}
"""Each expert's projections (a mixture of experts' `moe/<name>`), adapted only when `model.lora.targets` names them."""

_TARGET_ALIASES = {
    **{short: [short] for short in PROJECTIONS},
    **{name: [short] for short, name in PROJECTIONS.items()},  # our module names
    **{f"{short}_proj": [short] for short in ("q", "k", "v", "o", "gate", "up", "down")},  # Hugging Face Llama's
    "qkv_proj": ["q", "k", "v"],  # Phi-3's fused projections
    "gate_up_proj": ["gate", "up"],
    "c_attn": ["q", "k", "v"],  # GPT-2's fused projection, and its others
    "c_fc": ["up"],
    "c_proj": ["o", "down"],
    "attn.c_proj": ["o"],
    "mlp.c_proj": ["down"],
    **{short: [short] for short in EXPERT_PROJECTIONS},
    "experts": list(EXPERT_PROJECTIONS),  # every expert projection
    "w1": ["expert_gate"],  # Mixtral's expert projections
    "w3": ["expert_up"],
    "w2": ["expert_down"],
}


@dataclasses.dataclass(frozen=True)
class Lora:
    """`model.lora`, checked: rank, alpha, dropout, and the adapted projections by their short names."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


def lora_options(value: Mapping[str, Any] | None, mlp: str, moe: Mapping[str, Any] | Moe | None = None) -> Lora | None:
    """`model.lora`: null, or `{rank, alpha (default rank), dropout (0), targets (every projection the model has)}`;
    targets by our names (`q`, `query`), Hugging Face's (`q_proj`), GPT-2's (`c_attn`) or Phi-3's (`qkv_proj`,
    `gate_up_proj`). With `moe` (`model.moe`), the dense MLP's projections exist only when some layers keep one,
    and each expert's projections (`experts`, or `expert_gate`, `expert_up`, `expert_down`; Mixtral's `w1`, `w3`,
    `w2`) are adapted only when named."""
    if value is None:
        return None
    if isinstance(moe, Mapping):
        moe = moe_options(moe, 1 << 30)  # its layers are checked where the model is built
    dense_mlp = moe is None or bool(moe.dense_layers)
    has = [p for p in PROJECTIONS if (p in ("q", "k", "v", "o") or dense_mlp) and (mlp in GATED or p != "gate")]
    experts = list(EXPERT_PROJECTIONS) if moe is not None else []
    if not isinstance(value, Mapping):
        raise ValueError(f"model.lora must be null or {{rank, alpha, dropout, targets}}, got {value!r}")
    unknown = sorted(set(value) - {"rank", "alpha", "dropout", "targets"})
    if unknown:
        raise ValueError(f"model.lora has unknown keys {', '.join(unknown)}; it takes rank, alpha, dropout, targets")
    rank = value.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"model.lora.rank must be a positive integer, got {rank!r}")
    alpha = value.get("alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"model.lora.alpha must be a positive number, got {alpha!r}")
    dropout = value.get("dropout", 0.0)
    check_rate("lora.dropout", dropout)
    return Lora(rank, float(alpha), float(dropout), _lora_targets(value.get("targets", has), has, experts))


def _lora_targets(names: Any, has: list[str], experts: list[str] = ()) -> tuple[str, ...]:
    """`model.lora.targets` as short names, in the order of :data:`PROJECTIONS` then :data:`EXPERT_PROJECTIONS`;
    `has` is what the model has (and adapts by default), `experts` its expert projections."""
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ValueError(f"model.lora.targets must be a list of projection names, got {names!r}")
    targets: list[str] = []
    for name in names:
        shorts = _TARGET_ALIASES.get(name) if isinstance(name, str) else None
        missing = [t for t in shorts or [] if t not in has and t not in experts]
        if shorts is None or missing:
            also = f"; and each expert's {', '.join(experts)} (or all as experts)" if experts else ""
            raise ValueError(
                f"model.lora.targets: this model has no projection {name!r}; it has {', '.join(has)} (also as "
                f"{', '.join(PROJECTIONS[p] for p in has)} or {', '.join(p + '_proj' for p in has)}){also}"
            )
        targets += [t for t in shorts if t not in targets]
    return tuple(t for t in (*PROJECTIONS, *EXPERT_PROJECTIONS) if t in targets)


# Quantised storage of a frozen base (QLoRA)
# ------------------------------------------------------------------------------


QUANTIZE_TYPES = ("nf4", "fp4", "bfloat16")
QUANTIZE_BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' block sizes
_QUANTIZE_KEYS = ("type", "block", "double_quant", "compute_dtype", "skip")


@dataclasses.dataclass(frozen=True)
class Quantize:
    """`model.quantize`, checked: how the frozen base's projections are stored (see :func:`quantize_options`)."""

    type: str  # nf4 | fp4 (4 bits, nnx.QuantizedKernel) | bfloat16 (16 bits)
    block: int = 64
    double_quant: bool = True
    compute_dtype: Any = None  # the dtype the dequantised weights multiply in; None: model.dtype
    skip: tuple[str, ...] = ()  # projections (short names) kept as they are

    @property
    def four_bit(self) -> bool:
        return self.type in ("nf4", "fp4")

    def storage(self, compute: Any) -> Any:
        """The dtype of frozen weights not stored in 4 bits (embedding, head, skipped projections) when the model
        computes in `compute`: 16 bits with `type: bfloat16` or a bfloat16 compute dtype, else float32."""
        dtype = self.compute_dtype or compute
        return jnp.bfloat16 if self.type == "bfloat16" or dtype == jnp.bfloat16 else jnp.float32


def quantize_options(value: Mapping[str, Any] | None) -> Quantize | None:
    """`model.quantize`: null, or `{type: nf4 | fp4 | bfloat16, block (64), double_quant (true), compute_dtype
    (null: model.dtype; float32 or bfloat16), skip ([])}`: the frozen base's linear projections stored in 4 bits
    (bitsandbytes' NF4 or FP4 in blocks of `block`, their scales in 8 bits too with `double_quant`) or in
    bfloat16, all but the projections `skip` names (as `model.lora.targets` names them)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"model.quantize must be null or {{{', '.join(_QUANTIZE_KEYS)}}}, got {value!r}")
    unknown = sorted(set(value) - set(_QUANTIZE_KEYS))
    if unknown:
        raise ValueError(f"model.quantize has unknown keys {', '.join(unknown)}; it takes {', '.join(_QUANTIZE_KEYS)}")
    kind = value.get("type")
    if kind not in QUANTIZE_TYPES:
        raise ValueError(f"model.quantize.type must be one of {', '.join(QUANTIZE_TYPES)}; got {kind!r}")
    block = value.get("block", 64)
    if block not in QUANTIZE_BLOCKS or not isinstance(block, int) or isinstance(block, bool):  # 64.0 failed later
        raise ValueError(
            f"model.quantize.block must be one of {', '.join(map(str, QUANTIZE_BLOCKS))} (values per block scale); "
            f"got {block!r}"
        )
    double = value.get("double_quant", True)
    if not isinstance(double, bool):
        raise ValueError(f"model.quantize.double_quant must be true or false, got {double!r}")
    compute = value.get("compute_dtype")
    if compute is not None and compute not in DTYPES:
        raise ValueError(f"model.quantize.compute_dtype must be null or one of {', '.join(DTYPES)}; got {compute!r}")
    skip = value.get("skip") or []
    if isinstance(skip, str) or not isinstance(skip, Sequence):
        raise ValueError(f"model.quantize.skip must be a list of projection names, got {skip!r}")
    shorts: list[str] = []
    for name in skip:
        if not isinstance(name, str) or name not in _TARGET_ALIASES:
            known = ", ".join((*PROJECTIONS, *EXPERT_PROJECTIONS))
            raise ValueError(f"model.quantize.skip: {name!r} is not a projection; they are {known} (or q_proj, ...)")
        shorts += [s for s in _TARGET_ALIASES[name] if s not in shorts]
    return Quantize(kind, block, double, None if compute is None else DTYPES[compute], tuple(shorts))


# Mixture of experts
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Moe:
    """`model.moe`, checked: a sparse mixture of SwiGLU experts in place of the MLP (see :func:`moe_options`)."""

    num_experts: int
    top_k: int  # experts per token
    mlp_dim: int | None  # each expert's hidden width; None: model.mlp_dim
    normalize: bool  # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (model.mlp_dim wide)


_MOE_KEYS = ("num_experts", "top_k", "mlp_dim", "normalize", "dense_layers")


def moe_options(value: Mapping[str, Any] | None, num_layers: int) -> Moe | None:
    """`model.moe`: null (a dense MLP in every layer), or `{num_experts, top_k, mlp_dim (null: model.mlp_dim),
    normalize (true), dense_layers ([])}`: each token goes to the `top_k` experts of highest router probability,
    their outputs weighted by those probabilities (renormalised to sum to 1 when `normalize`: Mixtral always,
    Qwen3-MoE and OLMoE by `norm_topk_prob`); `dense_layers` keep a dense MLP (Qwen3-MoE's `mlp_only_layers`)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"model.moe must be null or {{{', '.join(_MOE_KEYS)}}}, got {value!r}")
    unknown = sorted(set(value) - set(_MOE_KEYS))
    if unknown:
        raise ValueError(f"model.moe has unknown keys {', '.join(unknown)}; it takes {', '.join(_MOE_KEYS)}")
    sizes = {}
    for key in ("num_experts", "top_k", "mlp_dim"):
        size = value.get(key)
        if size is None and key == "mlp_dim":
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"model.moe.{key} must be a positive integer, got {size!r}")
        sizes[key] = size
    if sizes["top_k"] > sizes["num_experts"]:
        raise ValueError(
            f"model.moe.top_k ({sizes['top_k']}) must be at most model.moe.num_experts ({sizes['num_experts']})"
        )
    normalize = value.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"model.moe.normalize must be true or false, got {normalize!r}")
    dense = value.get("dense_layers") or []
    if (
        isinstance(dense, str)
        or not isinstance(dense, Sequence)
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense)
    ):
        raise ValueError(f"model.moe.dense_layers must list layer indices below model.num_layers, got {dense!r}")
    return Moe(sizes["num_experts"], sizes["top_k"], sizes.get("mlp_dim"), normalize, tuple(sorted(set(dense))))


# The architecture
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What shapes a block's function, resolved and checked from the `model` options (see :func:`architecture`).

    Static: it lives in the ModuleDef, so it is hashable (`rope_scaling` is
    a tuple of `(key, value)` pairs).
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp: str  # gelu (tanh approximation) | swiglu | geglu
    qkv_bias: bool  # biases on q, k, v (also when `bias`)
    qk_norm: bool  # RMSNorm over each head's queries and keys
    bias: bool  # biases on every other projection and on LayerNorm
    norm: str  # layernorm | rmsnorm | gemma_rmsnorm (scaled by 1 + w)
    norm_eps: float
    rope: bool
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    dropout: float
    attention_dropout: float
    out_std: float  # initial std of the residual output projections
    remat: str
    scanned: bool
    dtype: Any  # compute dtype
    lora: Lora | None = None  # low-rank adapters on the projections it names
    # Gemma, Phi-3 and sliding windows (see `architecture` for the options)
    sliding_window: int | None = None  # a sliding layer's query sees this many positions, its own included
    sliding_layers: tuple[bool, ...] = ()  # per layer: does it slide (empty when no layer does)
    rope_local_theta: float | None = None  # the rotary base of sliding layers (Gemma 3); None: rope_theta
    rotary_dim: int | None = None  # the leading features of each head that rotate (Phi-3); None: all
    query_scale: float | None = None  # attention logits scaled by query_scale ** -0.5; None: head_dim
    attention_softcap: float | None = None  # attention logits as softcap * tanh(logits / softcap)
    post_norms: bool = False  # norms after attention and MLP too, before the residual sums (Gemma)
    # mixtures of experts
    moe: Moe | None = None  # a mixture of experts in place of the MLP (but in moe.dense_layers)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in training
    qk_norm_scope: str = "head"  # what qk_norm normalises: each head, or each projection's heads together
    quantize: Quantize | None = None  # how the frozen base's projections are stored (QLoRA)

    def quantized(self, projection: str) -> Quantize | None:
        """How `projection` (as :meth:`adapter` names them) is stored, or None (float32, trained or not)."""
        return self.quantize if self.quantize is not None and projection not in self.quantize.skip else None

    def storage(self) -> Any:
        """The dtype frozen weights outside the quantised projections are stored in (float32 without quantize)."""
        return jnp.float32 if self.quantize is None else self.quantize.storage(self.dtype)

    attention: str = "auto"  # model.attention: auto | core | xla | cudnn (attention.choose_attention)

    def adapter(self, projection: str) -> Lora | None:
        """The LoRA settings of `projection` (`q`, `k`, `v`, `o`, `gate`, `up`, `down`, `expert_gate`,
        `expert_up`, `expert_down`), or None."""
        return self.lora if self.lora is not None and projection in self.lora.targets else None

    def sparse(self, layer: int) -> bool:
        """Whether block `layer` holds a mixture of experts (else a dense MLP)."""
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def expert_mlp_dim(self) -> int:
        """The hidden width of each expert: `moe.mlp_dim`, or `mlp_dim`."""
        return self.moe.mlp_dim or self.mlp_dim if self.moe is not None else self.mlp_dim

    @property
    def kv_axis(self) -> str:
        """The logical axis of key and value heads: `heads` when every query head has its own, else `kv_heads`."""
        return "heads" if self.num_kv_heads == self.num_heads else "kv_heads"

    @property
    def layers_differ(self) -> bool:
        """Whether some layers slide and others do not: a scanned block then takes its layer's index to tell."""
        return len(set(self.sliding_layers)) > 1

    def slides(self, layer: int | None) -> bool | None:
        """Whether layer `layer` slides; None when that depends on a layer index not given (scanned, layers differ)."""
        if not self.layers_differ:
            return bool(self.sliding_layers) and self.sliding_layers[0]
        return None if layer is None else self.sliding_layers[layer]


def architecture(
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    head_dim: int | None,
    embed_dim: int,
    mlp_dim: int | None,
    mlp: str,
    qkv_bias: bool,
    qk_norm: bool,
    bias: bool,
    norm: str,
    norm_eps: float,
    positions: str,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    dropout: float,
    attention_dropout: float,
    remat: str,
    scan_layers: bool,
    dtype: str,
    lora: Mapping[str, Any] | None = None,
    sliding_window: int | None = None,
    layer_types: Sequence[str] | None = None,
    rope_local_theta: float | None = None,
    rotary_dim: int | None = None,
    query_scale: float | None = None,
    attention_softcap: float | None = None,
    post_norms: bool = False,
    moe: Mapping[str, Any] | None = None,
    router_aux_loss_coef: float = 0.0,
    qk_norm_scope: str = "head",
    quantize: Mapping[str, Any] | None = None,
    attention: str = "auto",
) -> Architecture:
    """The model options checked (a ValueError names the `model.` key) and resolved into an :class:`Architecture`.

    Sliding windows: with `sliding_window: W` a query at position `i` sees the keys at `i - W + 1 .. i` (as
    `transformers` counts), on every layer, or on those `layer_types` marks `sliding_attention` (one entry per
    layer, the others `full_attention`); `rope_local_theta` gives the sliding layers their own rotary base.
    `rotary_dim` rotates only the leading features of each head, `query_scale` scales the attention logits by
    `query_scale ** -0.5` instead of `head_dim ** -0.5`, `attention_softcap` squashes them to
    `softcap * tanh(logits / softcap)`, and `post_norms` adds a norm after attention and after the MLP.

    Blocks are scanned when `scan_layers` asks and they are alike: a mixture of experts with `dense_layers`
    mixes two kinds of block, which are then unrolled.
    """
    check_sizes("num_layers", [num_layers], one=True)
    check_sizes("num_heads", [num_heads], one=True)
    check_sizes("embed_dim", [embed_dim], one=True)
    mlp_dim = check_sizes("mlp_dim", [mlp_dim], one=True)[0] if mlp_dim is not None else 4 * embed_dim
    check_rate("dropout", dropout)
    check_rate("attention_dropout", attention_dropout)
    _choice("positions", positions, POSITIONS)
    _choice("norm", norm, NORMS)
    _choice("mlp", mlp, MLPS)
    _choice("dtype", dtype, tuple(DTYPES))
    _choice("remat", remat, REMATS)
    head_dim, kv_heads = _heads(embed_dim, num_heads, head_dim, num_kv_heads)
    _check_numbers(positions, head_dim, norm_eps, rope_theta, rope_scaling)
    sliding = _sliding_layers(num_layers, sliding_window, layer_types)
    _check_rotary(positions, head_dim, rope_local_theta, rotary_dim)
    for option, value in (("query_scale", query_scale), ("attention_softcap", attention_softcap)):
        _positive_or_null(option, value)
    experts = _experts(moe, num_layers, mlp, router_aux_loss_coef)
    _choice("qk_norm_scope", qk_norm_scope, QK_NORM_SCOPES)
    stored = quantize_options(quantize)
    if stored is not None and stored.four_bit:
        inputs = {"q": embed_dim, "k": embed_dim, "v": embed_dim, "o": num_heads * head_dim, "gate": embed_dim,
                  "up": embed_dim, "down": mlp_dim, "expert_gate": embed_dim, "expert_up": embed_dim,
                  "expert_down": (experts.mlp_dim or mlp_dim) if experts is not None else mlp_dim}  # fmt: skip
        dense_mlp = experts is None or bool(experts.dense_layers)  # a mixture's dense MLP: only in its dense layers

        def built(projection: str) -> bool:
            if projection.removeprefix("expert_") == "gate" and mlp not in GATED:
                return False
            if projection.startswith("expert_"):
                return experts is not None
            return projection in ("q", "k", "v", "o") or dense_mlp

        has = [p for p in inputs if built(p)]
        # an expert's projection named for a model without experts; a dense one a mixture lacks passes (a Hub
        # checkpoint's llm_int8_skip_modules name Mixtral's router "gate", read as the dense gate's name)
        absent = [p for p in stored.skip if p.startswith("expert_") and p not in has]
        if absent:
            raise ValueError(
                f"model.quantize.skip: this model has no projection {absent[0]!r}; it has {', '.join(has)}"
            )
        for projection, size in inputs.items():
            if projection in has and size % stored.block and projection not in stored.skip:
                raise ValueError(
                    f"model.quantize: the {projection} projection's input size ({size}) is not a multiple of "
                    f"model.quantize.block ({stored.block}); pick a block that divides it, or keep it as it is "
                    f"with model.quantize.skip=[{projection}]"
                )
    _choice("attention", attention, ATTENTIONS)
    return Architecture(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mlp_dim=mlp_dim,
        mlp=mlp,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        bias=bias,
        norm=norm,
        norm_eps=float(norm_eps),
        rope=positions == "rope",
        rope_theta=float(rope_theta),
        rope_scaling=check_rope_scaling(rope_scaling),
        dropout=dropout,
        attention_dropout=attention_dropout,
        out_std=0.02 / math.sqrt(2 * num_layers),
        remat=remat,
        scanned=scan_layers and (experts is None or len(experts.dense_layers) in (0, num_layers)),
        dtype=DTYPES[dtype],
        lora=lora_options(lora, mlp, experts),
        sliding_window=sliding_window if any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
        rope_local_theta=None if rope_local_theta is None else float(rope_local_theta),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        query_scale=None if query_scale is None else float(query_scale),
        attention_softcap=None if attention_softcap is None else float(attention_softcap),
        post_norms=post_norms,
        moe=experts,
        router_aux_loss_coef=float(router_aux_loss_coef),
        qk_norm_scope=qk_norm_scope,
        quantize=stored,
        attention=attention,
    )


def _experts(moe: Mapping[str, Any] | None, num_layers: int, mlp: str, router_aux_loss_coef: float) -> Moe | None:
    """`model.moe` checked: SwiGLU experts; `router_aux_loss_coef` a number at least 0."""
    experts = moe_options(moe, num_layers)
    if experts is not None and mlp != "swiglu":
        raise ValueError("model.moe: the experts are SwiGLU MLPs; set model.mlp=swiglu")
    coef = router_aux_loss_coef
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        raise ValueError(f"model.router_aux_loss_coef must be a number at least 0, got {coef!r}")
    return experts


def _choice(option: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"model.{option} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _heads(embed_dim: int, num_heads: int, head_dim: int | None, num_kv_heads: int | None) -> tuple[int, int]:
    """`(head_dim, num_kv_heads)`, checked: by default `embed_dim / num_heads` and one key-value head per query
    head."""
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"model.embed_dim ({embed_dim}) must be a multiple of model.num_heads ({num_heads}), "
                "or set model.head_dim"
            )
        head_dim = embed_dim // num_heads
    check_sizes("head_dim", [head_dim], one=True)
    kv_heads = num_heads if num_kv_heads is None else check_sizes("num_kv_heads", [num_kv_heads], one=True)[0]
    if num_heads % kv_heads:
        raise ValueError(
            f"model.num_heads ({num_heads}) must be a multiple of model.num_kv_heads ({kv_heads}): each key-value "
            "head serves an equal group of query heads"
        )
    return head_dim, kv_heads


def _check_numbers(
    positions: str, head_dim: int, norm_eps: float, rope_theta: float, rope_scaling: Mapping[str, Any] | None
) -> None:
    """An even head size for rotary positions, a positive `norm_eps` and `rope_theta`; `rope_scaling` only with
    rotary positions."""
    if positions == "rope" and head_dim % 2:
        raise ValueError(
            f"model.positions rope rotates pairs of features: the head size (model.head_dim, or embed_dim / "
            f"num_heads) ({head_dim}) must be even"
        )
    if norm_eps <= 0:
        raise ValueError(f"model.norm_eps must be positive, got {norm_eps}")
    if rope_theta <= 0:
        raise ValueError(f"model.rope_theta must be positive, got {rope_theta}")
    if rope_scaling is not None and positions != "rope":
        raise ValueError("model.rope_scaling applies to rotary positions: set model.positions=rope or drop it")


def _positive_or_null(option: str, value: Any) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"model.{option} must be null or a positive number, got {value!r}")


def _sliding_layers(num_layers: int, window: int | None, layer_types: Sequence[str] | None) -> tuple[bool, ...]:
    """Per layer, whether it attends within `sliding_window`: every layer, or those `layer_types` marks."""
    if window is not None:
        check_sizes("sliding_window", [window], one=True)
    if layer_types is None:
        return (window is not None,) * num_layers
    if isinstance(layer_types, str) or not isinstance(layer_types, Sequence) or len(layer_types) != num_layers:
        raise ValueError(
            f"model.layer_types must be a list of {num_layers} entries (one per layer), each one of "
            f"{', '.join(LAYER_TYPES)}; got {layer_types!r}"
        )
    unknown = [t for t in layer_types if t not in LAYER_TYPES]
    if unknown:
        raise ValueError(f"model.layer_types has {unknown[0]!r}; each entry is one of {', '.join(LAYER_TYPES)}")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    if any(sliding) and window is None:
        raise ValueError("model.layer_types has sliding_attention layers but model.sliding_window is null; set it")
    return sliding


def _check_rotary(positions: str, head_dim: int, local_theta: float | None, rotary_dim: int | None) -> None:
    """`rope_local_theta` positive, `rotary_dim` even and at most `head_dim`; both only with rotary positions."""
    for option, value in (("rope_local_theta", local_theta), ("rotary_dim", rotary_dim)):
        if value is not None and positions != "rope":
            raise ValueError(f"model.{option} applies to rotary positions: set model.positions=rope or drop it")
    _positive_or_null("rope_local_theta", local_theta)
    if rotary_dim is not None:
        check_sizes("rotary_dim", [rotary_dim], one=True)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"model.rotary_dim rotates pairs of a head's leading features: it must be even and at most the "
                f"head size ({head_dim}); got {rotary_dim}"
            )
