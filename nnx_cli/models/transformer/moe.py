"""A sparse mixture of experts in place of the MLP (Mixtral, Qwen3-MoE, OLMoE): each token goes to `top_k` of
`num_experts` SwiGLU MLPs, picked by a router.

The router's logits `x @ router` give probabilities `softmax(logits)` (in float32); each token takes the `top_k`
experts of highest probability, and its output is the sum of theirs weighted by those probabilities
(renormalised to sum to 1 when `moe.normalize`). Experts' weights are stacked along a leading logical axis
`expert` (`gate` and `fc` `[expert, embed, mlp]`, `proj` `[expert, mlp, embed]`), which the default rules put
on a mesh axis named `expert` when the mesh has one.

Dispatch sorts the (token, expert) assignments by expert, so that each expert multiplies only the rows sent to
it (grouped matmuls), never every token:

- `ragged`: :func:`jax.lax.ragged_dot` over the sorted rows, where the platform has a grouped kernel (GPU, TPU);
- `blocks`: on CPU, where `ragged_dot` computes every expert on every row (as slow as running all experts),
  each expert's rows are padded to whole blocks and one `lax.scan` multiplies each block by its expert's
  weights, skipping the blocks past the last one in use.

Both give the same numbers (to float rounding); `MoE.implementation` says which runs. The router also returns
what the load-balancing loss needs (:func:`load_balancing_loss`, as `transformers` computes it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import nnx
from nnx.nn.quantize import dequantize_kernel, no_gradient
from nnx_cli.models.transformer.dense import PROJECTION, Dense, as_stored, constrain, normal, sliceable
from nnx_cli.models.transformer.mlp import swiglu
from nnx_cli.models.transformer.options import Architecture, Lora, Quantize

EXPERT = "expert"
"""The logical axis of the experts' stacked weights."""

_MAX_BLOCK = 256  # rows per block of the CPU dispatch, at most
_MIN_BLOCK = 8


def grouped_implementation() -> str:
    """`ragged` (`lax.ragged_dot`) where the platform has a grouped matmul kernel (GPU, TPU), else `blocks`."""
    return "ragged" if nnx.spmd.platform() in ("gpu", "tpu") else "blocks"


# Routing
# ------------------------------------------------------------------------------


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(weights [N, top_k], experts [N, top_k], probabilities [N, E])` of router `logits` `[N, E]`, in float32:
    the `top_k` experts of highest probability, weighted by it (renormalised over the chosen when `normalize`)."""
    probabilities = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probabilities, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probabilities


def router_statistics(experts: jax.Array, probabilities: jax.Array, mask: jax.Array | None) -> dict[str, jax.Array]:
    """One layer's share of the load-balancing loss: `counts` `[E]` (times each expert was chosen), `probabilities`
    `[E]` (summed over tokens) and `rows` (tokens counted), over the tokens `mask` `[N]` marks (all when None)."""
    num_experts = probabilities.shape[-1]
    weight = jnp.ones(experts.shape[0], jnp.float32) if mask is None else mask.astype(jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=1)  # [N, E]
    return {
        "counts": weight @ chosen,
        "probabilities": weight @ probabilities,
        "rows": jnp.sum(weight),
    }


def load_balancing_loss(statistics: dict[str, jax.Array], num_experts: int) -> jax.Array:
    """Switch Transformer's auxiliary loss (Fedus et al., 2021, eqs. 4-6) as `transformers` computes it over
    layers: `E * sum_e f_e P_e`, `f_e` the fraction of top-k choices that went to expert `e` and `P_e` its mean
    router probability, both summed over the layers' statistics (:func:`router_statistics`) before dividing by
    all their rows. With `top_k` choices per token `sum_e f_e = top_k`: a uniform router gives `top_k`."""
    rows = jnp.maximum(statistics["rows"], 1.0)
    return num_experts * jnp.sum((statistics["counts"] / rows) * (statistics["probabilities"] / rows))


@jax.custom_vjp
def weighted_sum(weights: jax.Array, outputs: jax.Array) -> jax.Array:
    """Each token's sum of its experts' `outputs` `[tokens, top_k, embed]` weighted by `weights` `[tokens,
    top_k]`, in float32. The backward pass keeps `outputs` as they are: autodiff kept their float32 copy, twice
    a bfloat16 model's `[tokens, top_k, embed]` a layer."""
    return jnp.einsum("tk,tke->te", weights, outputs.astype(jnp.float32))


def _weighted_sum_forward(weights: jax.Array, outputs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return weighted_sum(weights, outputs), (weights, outputs)


def _weighted_sum_backward(saved: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    weights, outputs = saved
    d_weights = jnp.einsum("te,tke->tk", g, outputs.astype(jnp.float32)).astype(weights.dtype)
    return d_weights, (weights[:, :, None] * g[:, None, :]).astype(outputs.dtype)


weighted_sum.defvjp(_weighted_sum_forward, _weighted_sum_backward)


# Grouped matmuls
# ------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["sizes", "block_experts", "used"],
                   meta_fields=["block"])  # fmt: skip
@dataclasses.dataclass(frozen=True)
class Groups:
    """How sorted (token, expert) assignments lie in the grouped layout a :class:`GroupedDense` reads.

    `sizes` `[E]`: rows per expert. `ragged`: rows are the assignments sorted by expert. `blocks`: each
    expert's rows padded to whole blocks of `block` rows; `block_experts` `[blocks]` the expert of each block,
    `used` the number of blocks in use (the rest are zeros, and skipped).
    """

    sizes: jax.Array
    block: int = 0
    block_experts: jax.Array | None = None
    used: jax.Array | None = None

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """`x` `[rows, in]` in this layout times each row's expert's `w[e]` (`w` `[E, in, out]`): `[rows, out]`."""
        if self.block_experts is None:
            return lax.ragged_dot(x, w, self.sizes)
        return _blocks(self.block, x, w, self.block_experts, self.used)


def _block_products(block: int, x: jax.Array, w: jax.Array, block_experts: jax.Array, used: jax.Array) -> jax.Array:
    """Each block of `block` rows of `x` times its expert's `w[e]`, in a `lax.scan`; the blocks past `used`
    give zeros without a product."""
    stack = sliceable(w)

    def expert_weight(expert: jax.Array) -> jax.Array:
        return as_stored(lax.dynamic_index_in_dim(stack, expert, keepdims=False), w.dtype)

    return _scan_blocks(block, x, expert_weight, (w.shape[-1], jnp.result_type(x, w)), block_experts, used)


def _scan_blocks(
    block: int,
    x: jax.Array,
    expert_weight: Any,
    out: tuple[int, Any],
    block_experts: jax.Array,
    used: jax.Array,
) -> jax.Array:
    """Each block of `block` rows of `x` times `expert_weight(e)` `[in, out]` of its expert `e`, in a `lax.scan`
    that skips the blocks past `used` (zeros of `out`, `(features, dtype)`); the weight is made inside the
    block's step, so a 4-bit expert is dequantised for its own blocks only.

    Where XLA's CPU widens bfloat16 stacks (:func:`.residuals.packs`, JAX 0.10), 16-bit rows and products are
    sliced and stacked as their bits: stacked as bfloat16, the whole stack was widened to float32 and back in
    each block's step, so that the loop's time grew with the square of the blocks (64 experts of 512 x 256 in
    128 blocks, 4 layers: a bfloat16 QLoRA step took 3.5-4.1 s, now 1.7, with each expert dequantised here)."""
    blocks = block_experts.shape[0]
    features, dtype = out
    zeros = sliceable(jnp.zeros((block, features), dtype))

    def one(_: None, inputs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        index, rows, expert = inputs

        def product() -> jax.Array:
            w = expert_weight(expert)
            y = jnp.matmul(as_stored(rows, x.dtype), w, preferred_element_type=jnp.float32).astype(dtype)
            return sliceable(y)

        return None, lax.cond(index < used, product, lambda: zeros)

    rows = sliceable(x).reshape(blocks, block, x.shape[-1])
    _, y = lax.scan(one, None, (jnp.arange(blocks), rows, block_experts))
    return as_stored(y, dtype).reshape(blocks * block, features)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocks(block: int, x: jax.Array, w: jax.Array, block_experts: jax.Array, used: jax.Array) -> jax.Array:
    """:func:`_block_products`, whose backward pass keeps `x` and `w` alone. Autodiff of the scan kept every
    block's slice of its expert's kernel (`[blocks, in, out]`, each expert's weights several times over): with 8
    experts of 256 x 512 and 4,096 assignments in 24 blocks, 36 MiB a layer in float32 for the three
    projections. The kernel's gradient is summed block by block into its expert's, last block first, as
    autodiff summed it, in float32 whatever the kernel's dtype, rounded once at the end: summed in 16 bits, XLA's
    CPU widened the whole `[experts, in, out]` sum to float32 and back in each block's step (with 64 experts of
    512 x 256 in 128 blocks, 0.18 s a projection, a sixth of a bfloat16 training step)."""
    return _block_products(block, x, w, block_experts, used)


def _blocks_forward(block: int, x: jax.Array, w: jax.Array, block_experts: jax.Array, used: jax.Array) -> tuple:
    return _block_products(block, x, w, block_experts, used), (x, w, block_experts, used)


def _blocks_backward(block: int, saved: tuple, g: jax.Array) -> tuple:
    x, w, block_experts, used = saved
    blocks = block_experts.shape[0]
    dx = _block_products(block, g.astype(w.dtype), jnp.swapaxes(w, -1, -2), block_experts, used).astype(x.dtype)

    def one(dw: jax.Array, inputs: tuple[jax.Array, jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        index, rows, grads, expert = inputs

        def add() -> jax.Array:
            share = jnp.matmul(
                as_stored(rows, x.dtype).T, as_stored(grads, g.dtype), preferred_element_type=jnp.float32
            )
            return lax.dynamic_update_index_in_dim(dw, dw[expert] + share, expert, axis=0)

        return lax.cond(index < used, add, lambda: dw), None

    rows, grads = sliceable(x).reshape(blocks, block, x.shape[-1]), sliceable(g).reshape(blocks, block, g.shape[-1])
    dw = jnp.zeros(w.shape, jnp.float32)
    dw, _ = lax.scan(one, dw, (jnp.arange(blocks), rows, grads, block_experts), reverse=True)
    return dx, dw.astype(w.dtype), no_gradient(block_experts), no_gradient(used)


_blocks.defvjp(_blocks_forward, _blocks_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _quantized_blocks(
    block: int, spec: tuple[str, Any], x: jax.Array, parts: dict, block_experts: jax.Array, used: jax.Array
) -> jax.Array:
    """:func:`_block_products` for experts stored in 4 bits (`parts`, a stacked `nnx.QuantizedKernel`'s
    arrays; `spec` its type and the compute dtype): each block's expert dequantised in the block's own step, for
    its product only, the backward pass doing the same for the gradient with respect to `x`. Dequantising the
    whole stack for each product held every expert's weights in 16 bits at once (with 128 experts of 2,048 x
    768, 403 MB a projection in bfloat16) and dequantised every expert where a decoding step's few rows use
    only their own."""
    return _scan_blocks(block, x, _dequantizer(spec, parts), (parts["codes"].shape[-1], spec[1]), block_experts, used)


def _dequantizer(spec: tuple[str, Any], parts: dict, transposed: bool = False) -> Any:
    """`expert -> [in, out]` (`[out, in]` when `transposed`): one expert's kernel of the stack in `parts`,
    dequantised in `spec`'s dtype."""
    type, dtype = spec

    def weight(expert: jax.Array) -> jax.Array:
        own = {name: lax.dynamic_index_in_dim(array, expert, keepdims=False) for name, array in parts.items()}
        w = dequantize_kernel(own, type, dtype)
        return w.T if transposed else w

    return weight


def _quantized_blocks_forward(block: int, spec: tuple, x: jax.Array, parts: dict, block_experts: jax.Array,
                              used: jax.Array) -> tuple:  # fmt: skip
    y = _quantized_blocks(block, spec, x, parts, block_experts, used)
    return y, (parts, block_experts, used, jnp.zeros((), x.dtype))


def _quantized_blocks_backward(block: int, spec: tuple, saved: tuple, g: jax.Array) -> tuple:
    parts, block_experts, used, x_like = saved
    fan_in, dtype = 2 * parts["codes"].shape[-2], spec[1]
    weight = _dequantizer(spec, parts, transposed=True)
    dx = _scan_blocks(block, g.astype(dtype), weight, (fan_in, dtype), block_experts, used).astype(x_like.dtype)
    return dx, jax.tree.map(no_gradient, parts), no_gradient(block_experts), no_gradient(used)


_quantized_blocks.defvjp(_quantized_blocks_forward, _quantized_blocks_backward)


def sort_by_expert(experts: jax.Array, num_experts: int, implementation: str) -> tuple[Groups, jax.Array, jax.Array]:
    """Sort the assignments `experts` `[N, k]` by expert: `(groups, sources, positions)`, `sources` `[rows]`
    the token each row of the grouped layout reads (`N`: a padding row of zeros), `positions` `[N, k]` the row
    that holds each assignment's result."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment of each sorted row (token-major within an expert)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    count = flat.shape[0]
    rank = jnp.zeros(count, jnp.int32).at[order].set(jnp.arange(count, dtype=jnp.int32))  # sorted row of each
    if implementation == "ragged":
        return Groups(sizes), order // k, rank.reshape(tokens, k)
    block = _block_size(count, num_experts)
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(padded)
    starts, sorted_starts = ends - padded, jnp.cumsum(sizes) - sizes
    expert_of = flat[order]
    destination = starts[expert_of] + jnp.arange(count) - sorted_starts[expert_of]  # padded row of sorted row
    blocks = -(-count // block) + min(num_experts, count)  # each used expert wastes less than one block
    sources = jnp.full(blocks * block, tokens, jnp.int32).at[destination].set(order // k)
    block_experts = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), num_experts - 1)
    groups = Groups(sizes, block, block_experts.astype(jnp.int32), ends[-1] // block)
    return groups, sources, destination[rank].reshape(tokens, k)


def _block_size(rows: int, num_experts: int) -> int:
    """Rows per block: the largest power of two within half a balanced expert's share, within [8, 256]. Each
    expert's rows are padded to whole blocks, half a block each on average: blocks of a whole share multiplied
    about 1.5x the rows, and blocks of half a share ran 5-12% faster steps with less memory (64 experts, top
    8, `benchmarks/moe_step.py`: bfloat16, float32 and QLoRA)."""
    share = max(1, rows // num_experts // 2)
    return int(min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << (share.bit_length() - 1))))


def _grouped(block: int, x: jax.Array, w: jax.Array, *operands: Any) -> jax.Array:
    """`Groups(*operands).matmul(x, w)` (`operands`: sizes, and the blocks' experts and count in use)."""
    sizes, *blocks, _ = operands
    return Groups(sizes, block, *blocks).matmul(x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _narrowed_grouped(block: int, x: jax.Array, kernel: jax.Array, operands: tuple) -> jax.Array:
    """:func:`_grouped` of `x` and the experts' `kernel` narrowed to `x`'s dtype (float32 weights of a bfloat16
    model), keeping the kernel as given for the backward pass, which narrows it again. Narrowed outside, the
    bfloat16 copy of every expert's weights was a residual the layer scan stacked, with the float32 copies a
    CPU made of it (a full fine-tuning step's temporaries 1,425 MiB against 1,089 now, 8 layers of 8 experts
    512 x 512, batch 8 x 256)."""
    return _grouped(block, x, kernel.astype(x.dtype), *operands, None)


def _narrowed_grouped_forward(block: int, x: jax.Array, kernel: jax.Array, operands: tuple) -> tuple:
    return _narrowed_grouped(block, x, kernel, operands), (x, kernel, operands)


def _narrowed_grouped_backward(block: int, saved: tuple, g: jax.Array) -> tuple:
    x, kernel, operands = saved
    _, backward = jax.vjp(lambda x, w: _grouped(block, x, w.astype(x.dtype), *operands, None), x, kernel)
    dx, dw = backward(g.astype(x.dtype))
    return dx, dw, jax.tree.map(no_gradient, operands)


_narrowed_grouped.defvjp(_narrowed_grouped_forward, _narrowed_grouped_backward)


def _grouped_transpose(block: int, g: jax.Array, w: jax.Array, *operands: Any) -> jax.Array:
    """The transpose of :func:`_grouped` in `x`: each row's gradient by its expert's kernel transposed."""
    return _grouped(block, g, jnp.swapaxes(w, -1, -2), *operands)


class GroupedDense(nnx.Module):
    """`num_experts` stacked kernels `[expert, in, out]` applied to rows in a grouped layout (:class:`Groups`),
    each row by its expert's kernel; with `lora`, a low-rank adapter per expert (`a` `[expert, in, rank]`,
    normal init as `nnx.LoRA`'s; `b` `[expert, rank, out]`, zeros). With `quantize` the kernels are stored in 4
    bits (one `nnx.QuantizedKernel` stacking the experts: in `blocks` each block's expert dequantised for
    that block's product, in `ragged` the whole stack for the layer's) or in bfloat16."""

    def __init__(
        self,
        num_experts: int,
        features: tuple[int, int],
        axes: tuple[str, str],
        *,
        std: float,
        dtype: Any,
        lora: Lora | None,
        quantize: Quantize | None = None,
        ctx: nnx.Context,
    ):
        key = ctx.make_rng("params")
        shape = (num_experts, *features)
        if quantize is not None and quantize.four_bit:
            self.kernel = nnx.QuantizedKernel(
                features[0],
                features[1],
                type=quantize.type,
                block=quantize.block,
                double_quant=quantize.double_quant,
                batch=(num_experts,),
                in_axes=axes[:1],
                out_axes=axes[1:],
                batch_axes=(EXPERT,),
                value=nnx.initializers.normal(std)(key, shape, jnp.float32),
            )
        else:
            kernel_dtype = jnp.float32 if quantize is None else jnp.bfloat16
            self.kernel = nnx.Param(normal(std, (EXPERT, *axes))(key, shape, kernel_dtype))
        self.compute_dtype = (quantize.compute_dtype if quantize is not None else None) or dtype
        self.dtype = dtype
        if lora is not None:  # drawn from the kernel's key: the frozen weights are the same with or without it
            self.lora = ExpertLoRA(num_experts, features, axes, lora, dtype, jax.random.fold_in(key, 1))
        else:
            self.lora = None

    def __call__(
        self, x: jax.Array, groups: Groups, *, deterministic: bool = True, ctx: nnx.Context | None = None
    ) -> jax.Array:
        kernel, compute = nnx.containers.stored_value(self, "kernel"), self.compute_dtype  # as Dense reads it
        operands = (
            (groups.sizes,) if groups.block_experts is None else (groups.sizes, groups.block_experts, groups.used)
        )
        if isinstance(kernel, nnx.QuantizedKernel) and groups.block_experts is not None:
            spec = (kernel.type, jnp.dtype(compute))
            y = _quantized_blocks(groups.block, spec, x.astype(compute), kernel.parts(), *operands[1:])
        elif isinstance(kernel, nnx.QuantizedKernel):  # ragged_dot multiplies the whole stack
            product, transpose = (
                functools.partial(_grouped, groups.block),
                functools.partial(_grouped_transpose, groups.block),
            )
            y = nnx.dequantized_product(product, transpose, x.astype(compute), kernel, compute, *operands)
        elif kernel.dtype != jnp.dtype(compute):
            y = _narrowed_grouped(groups.block, x.astype(compute), kernel, operands)
        else:
            y = groups.matmul(x.astype(compute), kernel)
        y = y.astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x, groups, deterministic=deterministic, ctx=ctx).astype(y.dtype)
        return y


class ExpertLoRA(nnx.Module):
    """Each expert's low-rank update `dropout(x) @ a[e] @ b[e] * (alpha / rank)`, on rows in a grouped layout."""

    def __init__(self, num_experts: int, features: tuple[int, int], axes: tuple[str, str], lora: Lora, dtype: Any,
                 key: jax.Array):  # fmt: skip
        fan_in, fan_out = features
        a_key, b_key = jax.random.split(key)
        a_init = nnx.with_logical_partitioning(nnx.initializers.normal((3 * fan_in) ** -0.5), (EXPERT, axes[0], None))
        b_init = nnx.with_logical_partitioning(nnx.initializers.zeros(), (EXPERT, None, axes[1]))
        self.a = nnx.LoRAParam(a_init(a_key, (num_experts, fan_in, lora.rank), jnp.float32))
        self.b = nnx.LoRAParam(b_init(b_key, (num_experts, lora.rank, fan_out), jnp.float32))
        self.scale = lora.alpha / lora.rank
        self.dtype = dtype
        self.dropout = nnx.Dropout(lora.dropout)

    def __call__(
        self, x: jax.Array, groups: Groups, *, deterministic: bool = True, ctx: nnx.Context | None = None
    ) -> jax.Array:
        x = self.dropout(x, deterministic=deterministic, ctx=ctx).astype(self.dtype)
        a, b = (nnx.containers.stored_value(self, name).astype(self.dtype) for name in ("a", "b"))
        return groups.matmul(groups.matmul(x, a), b) * jnp.asarray(self.scale, self.dtype)

    def delta(self) -> jax.Array:
        """Each expert's update as a full matrix `[expert, in, out]`, in float32: what merging adds to the kernel."""
        return jnp.matmul(self.a, self.b) * self.scale


# The layer
# ------------------------------------------------------------------------------


class MoE(nnx.Module):
    """A router over `moe.num_experts` SwiGLU experts, each `moe.mlp_dim` wide; each token is sent to `top_k` of
    them (see the module docstring). Returns the output and the router's :func:`router_statistics`."""

    def __init__(self, arch: Architecture, *, implementation: str | None = None, ctx: nnx.Context):
        moe, embed, hidden = arch.moe, arch.embed_dim, arch.expert_mlp_dim
        assert moe is not None
        self.router = Dense((embed,), (moe.num_experts,), ("embed",), (None,), std=0.02, dtype=arch.dtype,
                            use_bias=False, out_dtype=jnp.float32, ctx=ctx)  # fmt: skip
        experts = dict(std=0.02, dtype=arch.dtype, ctx=ctx)
        up = ("embed", "mlp")
        self.gate = GroupedDense(moe.num_experts, (embed, hidden), up, lora=arch.adapter("expert_gate"),
                                 quantize=arch.quantized("expert_gate"), **experts)  # fmt: skip
        self.fc = GroupedDense(moe.num_experts, (embed, hidden), up, lora=arch.adapter("expert_up"),
                               quantize=arch.quantized("expert_up"), **experts)  # fmt: skip
        self.proj = GroupedDense(moe.num_experts, (hidden, embed), ("mlp", "embed"), std=arch.out_std,
                                 dtype=arch.dtype, lora=arch.adapter("expert_down"),
                                 quantize=arch.quantized("expert_down"), ctx=ctx)  # fmt: skip
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.normalize = moe.normalize
        self.dtype = arch.dtype
        self.implementation = implementation or grouped_implementation()
        self.dropout = nnx.Dropout(arch.dropout)

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`x` `[batch, length, embed]` through the experts; `mask` `[batch, length]` marks the tokens the
        load-balancing statistics count (all when None)."""
        train = dict(deterministic=deterministic, ctx=ctx)
        return self.down(self.up(x, **train), x.shape, mask, **train)

    def up(self, x: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None) -> Routed:
        """The router on `x` `[batch, length, embed]`, and the experts' gate and up projections of the rows it
        sends them. Their outputs are tagged `projection`, as a `Dense` output is: a block in training runs its
        norm and this rematerialised (`Block._normed`), keeping those and the router's logits, and remaking the
        norm's output and the grouped rows (`[tokens * top_k, embed]`) for the backward pass."""
        train = dict(deterministic=deterministic, ctx=ctx)
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts, probabilities = route(self.router(tokens), self.top_k, self.normalize)
        groups, sources, positions = sort_by_expert(experts, self.num_experts, self.implementation)
        rows = jnp.concatenate([tokens, jnp.zeros((1, x.shape[-1]), tokens.dtype)])[sources]
        gate = checkpoint_name(self.gate(rows, groups, **train), PROJECTION)
        fc = checkpoint_name(self.fc(rows, groups, **train), PROJECTION)
        return Routed(weights, experts, probabilities, groups, positions, gate, fc)

    def down(
        self,
        routed: Routed,
        shape: tuple[int, ...],
        mask: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The rest of the layer from :meth:`up`'s `routed`, for an input of `shape`: the activation, the down
        projection, each token's weighted sum of its experts' outputs, dropout; and the router statistics."""
        train = dict(deterministic=deterministic, ctx=ctx)
        weights, experts, probabilities, groups, positions, gate, fc = routed
        statistics = router_statistics(experts, probabilities, None if mask is None else mask.reshape(-1))
        project = MoE._project
        if not deterministic:  # training: the activation is remade for the backward pass, as the dense MLP's is
            project = nnx.remat(project, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
        out = project(self, gate, fc, groups, **train)  # [rows, embed]
        combined = weighted_sum(weights, out[positions])
        y = constrain(combined.astype(self.dtype).reshape(shape), ("batch", "length", "embed"))
        return self.dropout(y, deterministic=deterministic, ctx=ctx), statistics

    def _project(
        self, gate: jax.Array, fc: jax.Array, groups: Groups, *, deterministic: bool, ctx: nnx.Context | None = None
    ) -> jax.Array:
        """`proj(silu(gate) * fc)` on the grouped rows. Rematerialised in training: the backward pass remakes the
        activation (`[tokens * top_k, mlp_dim]`, one element-wise pass over `gate` and `fc`, which are kept
        anyway) for the down projection's gradients instead of keeping it; the product is not redone."""
        hidden = swiglu(gate, fc)  # keeps gate and up only
        return checkpoint_name(self.proj(hidden.astype(self.dtype), groups, deterministic=deterministic, ctx=ctx),
                               PROJECTION)  # fmt: skip


class Routed(NamedTuple):
    """What :meth:`MoE.up` gives :meth:`MoE.down`: the routing (`weights`, `experts` and `probabilities` as
    :func:`route` gives them; `groups` and `positions` as :func:`sort_by_expert` does) and the grouped rows'
    gate and up projections."""

    weights: jax.Array
    experts: jax.Array
    probabilities: jax.Array
    groups: Groups
    positions: jax.Array
    gate: jax.Array
    fc: jax.Array
