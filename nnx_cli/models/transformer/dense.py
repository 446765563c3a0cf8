"""`Dense`, the projection every part of the model is made of, and the logical-axis helpers they share.

Parameters carry logical axes (`embed`, `heads`, `kv_heads`, `kv`, `mlp`,
`vocab`, and `layers` when the blocks are scanned) that the model's
`default_rules` or `sharding.rules` map onto the mesh; activations are
constrained to logical axes at the seams (:func:`constrain`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import nnx
from nnx.nn.quantize import dequantize_kernel, no_gradient, two_rows
from nnx_cli.models.transformer.options import Lora, Quantize
from nnx_cli.models.transformer.residuals import packs

LAYERS = "layers"
"""The logical axis of the scanned blocks' stacked parameters and key-value caches."""

PROJECTION = "projection"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of every `Dense` output: what `model.remat: dots` keeps. A
remat policy cannot see the products inside the layers' custom VJPs, and `dots_with_no_batch_dims_saveable`
alone saved none of them (recomputing every projection, as `full` does)."""


def normal(std: float, axes: tuple[str, ...]) -> Any:
    """An initializer drawing from normal(`std`), its result on logical `axes`."""
    return nnx.with_logical_partitioning(nnx.initializers.normal(std), axes)


def constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` constrained to the logical `axes` (one name per dimension)."""
    return nnx.with_logical_constraint(x, axes)


def matmul(x: jax.Array, kernel: jax.Array, in_rank: int, out_dtype: Any = None) -> jax.Array:
    """`x @ kernel` in `x`'s dtype, contracting the trailing `in_rank` axes of `x` with the leading ones of
    `kernel`, as one 2D matmul `[tokens, in] @ [in, out]`. A kernel in another dtype (float32 parameters of a
    bfloat16 model) is converted to `x`'s for the product; its gradient comes back in its own dtype.

    The weight gradient is then the 2D matmul `x^T g` over `[tokens,
    features]`; contracted over the batch and length axes at once, XLA
    copied the output gradient transposed to feed it (the SwiGLU gradient as
    `[mlp, tokens]`, the tied head's as `[vocab, tokens]`). The kernel is
    reshaped and converted inside the product's custom VJP, which keeps it as
    given: under the layer scan the backward pass reads each layer's slice of
    the stacked parameter, where a reshaped or converted kernel was a
    residual that the scan stacked again (the attention projections'
    weights at SmolLM2's shapes: 101 MiB of a LoRA step's 1,083; every
    weight, converted to bfloat16, in a bfloat16 full fine-tuning step's
    1,403, 152 MiB). Contracting the `[embed, heads, kv]` kernel as it is
    instead (no reshape) took the query projection's forward and backward
    1.3x the time on a CPU.
    """
    tokens, out_shape = x.shape[: x.ndim - in_rank], kernel.shape[in_rank:]
    return _matmul2d(x, kernel, out_dtype, in_rank).reshape(*tokens, *out_shape)


def _flat(x: jax.Array, in_rank: int) -> jax.Array:
    """`x` as `[tokens, in]`: its trailing `in_rank` axes flattened into one, the others into the other."""
    return x.reshape(math.prod(x.shape[: x.ndim - in_rank]), -1)


def cpu_products() -> bool:
    """Whether 16-bit products are accumulated in float32 and rounded once, a single row repeated to two
    (:func:`_product`): on a CPU. Up to JAX 0.10 XLA's CPU widened both operands of a product with a 16-bit
    result to float32 first; from 0.11 on it multiplies them as stored for two rows or more, but a one-row
    product still widens the whole matrix (2.3x the time of the two-row float32 product at 896 x 4,864)."""
    return nnx.spmd.platform() == "cpu"


def _product(x: jax.Array, w: jax.Array, contract: tuple, out_dtype: Any) -> jax.Array:
    """`lax.dot_general(x, w)` contracting `contract`, in `out_dtype` (else `x`'s dtype). On a CPU a 16-bit
    result is accumulated in float32 and rounded once: XLA's CPU computes a product of 16-bit operands with a
    16-bit result by widening both to float32 first (a float32 copy of the kernel and of its gradient's
    operands in each step); with a float32 result it multiplies them as stored, 2.5-3.7x faster at 1,024 x 896
    x 4,864, and the weight gradient `x^T g` about 2x."""
    out = jnp.dtype(out_dtype or x.dtype)
    if cpu_products() and out.itemsize == 2:
        product = lax.dot_general(two_rows(x), w, (contract, ((), ())), preferred_element_type=jnp.float32)
        return product[: x.shape[0]].astype(out)
    return lax.dot_general(x, w, (contract, ((), ())), preferred_element_type=out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul2d(x: jax.Array, kernel: jax.Array, out_dtype: Any, in_rank: int) -> jax.Array:
    """`x` (as `[tokens, in]`, :func:`_flat`) `@ kernel` (seen as `[in, out]`) in `x`'s dtype, `[tokens, out]`,
    keeping for the backward pass `x` and the kernel as given, which it reshapes and converts again there: the
    array kept is then the one its producer returned (the attention core keeps its output too, and the scan
    stacked each reshaped copy as a residual of its own). The kernel's gradient `x^T g` is accumulated in
    float32 and given in the kernel's dtype (not rounded to `x`'s first)."""
    x2 = _flat(x, in_rank)
    return _product(x2, kernel.astype(x.dtype).reshape(x2.shape[1], -1), ((1,), (0,)), out_dtype)


def _matmul2d_forward(x: jax.Array, kernel: jax.Array, out_dtype: Any, in_rank: int) -> tuple[jax.Array, tuple]:
    return _matmul2d(x, kernel, out_dtype, in_rank), (x, kernel)


def _matmul2d_backward(out_dtype: Any, in_rank: int, saved: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x_in, kernel = saved
    x = _flat(x_in, in_rank)
    wide = x.astype(g.dtype) if g.dtype.itemsize > x.dtype.itemsize else x  # a float32 result's (the router's)
    g = g.astype(wide.dtype)
    dx = _product(g, kernel.astype(wide.dtype).reshape(-1, g.shape[1]), ((1,), (1,)), x.dtype)
    dw = lax.dot_general(wide, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.reshape(x_in.shape), dw.reshape(kernel.shape).astype(kernel.dtype)


_matmul2d.defvjp(_matmul2d_forward, _matmul2d_backward)


def _frozen_weight(kernel: jax.Array, fan_in: int, compute: Any) -> jax.Array:
    """A frozen kernel as the `[in, out]` matrix it multiplies by, in `compute`: given as stored or as its
    bfloat16 bits (`uint16`, :func:`as_bits`)."""
    if kernel.dtype == jnp.uint16:
        kernel = lax.bitcast_convert_type(kernel, jnp.bfloat16)
    return kernel.astype(compute).reshape(fan_in, -1)


def as_bits(kernel: jax.Array) -> jax.Array:
    """A bfloat16 frozen kernel's bits as `uint16`: what a CPU slices out of a stack without widening it all."""
    return lax.bitcast_convert_type(kernel, jnp.uint16)


@contextlib.contextmanager
def frozen_kernels_as_bits(module: nnx.Module) -> Iterator[None]:
    """On a CPU that widens bfloat16 (:func:`.residuals.packs`), the bfloat16 frozen kernels (`model.quantize:
    {type: bfloat16}`) of `module`'s Dense layers held as their bits (:func:`as_bits`) for the duration, then as
    they were.

    Around the layer scan: XLA's CPU backend up to JAX 0.10 has no bfloat16 `dynamic-slice`, so it would widen each
    stacked kernel to float32 to take a layer's slice, hoisting that out of the loop whole (1.3 GB more than the
    bfloat16 base itself at Qwen2.5-0.5B's shapes); a uint16 stack it slices as it is. A frozen kernel has no gradient,
    so its bits lose nothing; a GPU slices bfloat16 as it is."""
    if not packs():
        yield
        return
    held = []
    for _, dense in module.modules():
        kernel = dense.kernel if isinstance(dense, Dense) and dense.frozen else None
        if isinstance(kernel, jax.Array) and kernel.dtype == jnp.bfloat16:
            held.append((dense, kernel))
            dense.kernel = as_bits(kernel)
    try:
        yield
    finally:
        for dense, kernel in held:
            dense.kernel = kernel


def sliceable(weights: jax.Array) -> jax.Array:
    """A 16-bit array as its bits (`uint16`), to be sliced, gathered from or stacked by a loop, where XLA's CPU
    has no bfloat16 dynamic-slice (:func:`.residuals.packs`: up to JAX 0.10) and widened the whole array to float32
    to take each part (a table: 0.5 s and 520 MB a step at Qwen2.5's 151,936 x 896; a loop's stack: widened and
    narrowed again in every step of the loop). Other dtypes, and every dtype elsewhere, as they are."""
    return lax.bitcast_convert_type(weights, jnp.uint16) if weights.dtype.itemsize == 2 and packs() else weights


def as_stored(part: jax.Array, dtype: Any) -> jax.Array:
    """A part of :func:`sliceable`'s array (its bits, or the array as it was) in `dtype` again."""
    return (
        lax.bitcast_convert_type(part, dtype) if part.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16 else part
    )


def lookup(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """`embed(tokens)`; on a CPU that widens bfloat16 (:func:`.residuals.packs`) a bfloat16 table is gathered
    from as its bits (:func:`as_bits`).

    XLA's CPU up to JAX 0.10 gathers bfloat16 rows by widening the table to float32 in the gather's fusion; when the
    step runs inside a loop (several steps a dispatch), that widening of the whole table is loop-invariant and XLA
    hoists it out of the loop, a float32 copy of the table beside the step (519 MiB at Qwen2.5-0.5B's 151,936 x 896).
    The model's tables are bfloat16 only as a quantised base's (`Quantize.storage`), frozen: a table with no gradient
    loses nothing as bits (a bitcast would cut one). Out-of-range tokens give NaN rows either way."""
    table = embed.embedding
    if not (packs() and embed.num_embeddings > 1 and table.dtype == jnp.bfloat16):
        return embed(tokens)
    rows = lax.bitcast_convert_type(jnp.take(as_bits(table), jnp.asarray(tokens), axis=0), jnp.bfloat16)
    return rows.astype(embed.dtype or jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def frozen_matmul(x: jax.Array, kernel: jax.Array, out_dtype: Any, compute: Any) -> jax.Array:
    """`x @ kernel` (`[tokens, in] @ kernel` seen as `[in, out]`, in `compute`) for a frozen kernel, given as
    stored or as its bfloat16 bits (:func:`as_bits`): the backward pass gives `x` its gradient `g kernel^T`
    and the kernel none, keeping nothing but the kernel itself, as it was given (a scanned layer's slice of
    the stack, which the scan then does not stack again)."""
    w = _frozen_weight(kernel, x.shape[1], compute)
    contract = (((1,), (0,)), ((), ()))
    # accumulated in float32: XLA's CPU product of 16-bit operands is 2.5x faster so
    product = lax.dot_general(two_rows(x.astype(compute)), w, contract, preferred_element_type=jnp.float32)
    return product[: x.shape[0]].astype(out_dtype or compute)


def _frozen_forward(x: jax.Array, kernel: jax.Array, out_dtype: Any, compute: Any) -> tuple[jax.Array, tuple]:
    return frozen_matmul(x, kernel, out_dtype, compute), (kernel, jnp.zeros((), x.dtype))


def _frozen_backward(out_dtype: Any, compute: Any, saved: tuple, g: jax.Array) -> tuple[jax.Array, Any]:
    kernel, x_like = saved
    w = _frozen_weight(kernel, kernel.size // g.shape[1], compute)
    dx = lax.dot_general(g.astype(w.dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x_like.dtype), no_gradient(kernel)


frozen_matmul.defvjp(_frozen_forward, _frozen_backward)


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """`y + bias` over `y`'s trailing axes, added in float32 and rounded once to `y`'s dtype (`y` without bias).

    The bias's gradient is then the sum of the output gradient over the tokens in float32. Added in a 16-bit
    `y`'s dtype, it was that sum in 16 bits: about 1% off the float32 sum at 2,048 rows, which XLA's CPU
    computes in windows of 32 rows (a 768 -> 3,072 projection's forward and backward at 2,048 tokens took
    120-124 ms so against 127-136); PyTorch's bias gradient accumulates in float32 too."""
    if bias is None:
        return y
    wide = jnp.promote_types(y.dtype, jnp.float32)
    return (y.astype(wide) + bias.astype(wide)).astype(y.dtype)


class Dense(nnx.Module):
    """`x @ kernel + bias`, contracting the trailing `len(in_shape)` axes of `x`.

    The kernel has shape `in_shape + out_shape` and logical axes
    `in_axes + out_axes` (attention's query kernel is `(embed, heads, kv)`,
    its output kernel `(heads, kv, embed)`); it is drawn from normal(`std`),
    the bias starts at zero. Computes in `dtype` (the result in `out_dtype`
    if given, e.g. float32 logits from bfloat16 inputs); parameters are
    float32 (the kernel `param_dtype`). With `lora`, a low-rank adapter
    (`nnx.LoRA`) adds its update. With `quantize` (a frozen base's, QLoRA)
    the kernel is stored in 4 bits (an `nnx.QuantizedKernel`, multiplied in
    `quantize.compute_dtype`, else `dtype`) or in bfloat16::

        query = Dense((384,), (6, 64), ("embed",), ("heads", "kv"), std=0.02, dtype=jnp.float32, ctx=ctx)
        query(jnp.ones((2, 10, 384))).shape   # (2, 10, 6, 64)
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        *,
        std: float,
        dtype: Any,
        use_bias: bool = True,
        out_dtype: Any = None,
        lora: Lora | None = None,
        quantize: Quantize | None = None,
        param_dtype: Any = jnp.float32,
        ctx: nnx.Context,
    ):
        self.in_rank = len(in_shape)
        self.dtype = dtype
        self.out_dtype = out_dtype
        shape = (*in_shape, *out_shape)
        key = ctx.make_rng("params")
        if quantize is not None and quantize.four_bit:
            self.kernel = nnx.QuantizedKernel(
                in_shape,
                out_shape,
                type=quantize.type,
                block=quantize.block,
                double_quant=quantize.double_quant,
                in_axes=in_axes,
                out_axes=out_axes,
                value=nnx.initializers.normal(std)(key, shape, jnp.float32),
            )
        else:
            kernel_dtype = jnp.bfloat16 if quantize is not None else param_dtype
            self.kernel = nnx.Param(normal(std, (*in_axes, *out_axes))(key, shape, kernel_dtype))
        self.compute_dtype = (quantize.compute_dtype if quantize is not None else None) or dtype
        self.frozen = quantize is not None  # a 16-bit frozen base: no gradient, nothing kept for one
        if use_bias:
            bias_init = nnx.with_logical_partitioning(nnx.initializers.zeros(), out_axes)
            self.bias = nnx.Param(bias_init(ctx.make_rng("params"), tuple(out_shape), jnp.float32))
        else:
            self.bias = None
        if lora is not None:  # drawn from the kernel's key: the frozen weights are the same with or without it
            self.lora = nnx.LoRA(
                in_shape,
                out_shape,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                in_axes=in_axes,
                out_axes=out_axes,
                dtype=dtype,
                ctx=nnx.context(jax.random.fold_in(key, 1)),
            )
        else:
            self.lora = None

    def __call__(self, x: jax.Array, *, deterministic: bool = True, ctx: nnx.Context | None = None) -> jax.Array:
        kernel = nnx.containers.stored_value(self, "kernel")  # not constrained: a scan would stack it again
        if self._adapts_in_one_product(x):
            return checkpoint_name(add_bias(self._adapted(x, kernel, deterministic, ctx), self.bias), PROJECTION)
        if isinstance(kernel, nnx.QuantizedKernel):
            y = kernel(x, dtype=self.compute_dtype, out_dtype=self.out_dtype).astype(self.out_dtype or self.dtype)
        elif self.frozen:
            tokens, out_shape = x.shape[: x.ndim - self.in_rank], kernel.shape[self.in_rank :]
            x2 = x.astype(self.compute_dtype).reshape(math.prod(tokens), -1)
            y = frozen_matmul(x2, kernel, self.out_dtype, self.compute_dtype).reshape(*tokens, *out_shape)
            y = y.astype(self.out_dtype or self.dtype)
        else:
            y = matmul(x.astype(self.compute_dtype), kernel, self.in_rank, self.out_dtype)
            y = y.astype(self.out_dtype or self.dtype)
        if self.lora is not None:
            y = y + self.lora(x, deterministic=deterministic, ctx=ctx).astype(y.dtype)
        return checkpoint_name(add_bias(y, self.bias), PROJECTION)

    def _adapts_in_one_product(self, x: jax.Array) -> bool:
        """Whether the adapter's update is computed with the base product (`nnx.LoRA.adapt`): on a CPU, in
        16 bits, for more than one token. XLA's CPU multiplies the update's 16-bit products, computed apart,
        by widening or writing `[tokens, out]` activations in float32. Forward and backward of a projection
        and its rank-16 adapter at 1,024 tokens: 896 -> 4,864 72 ms apart, 50 in one product; 4,864 -> 896
        76 against 62 ms; a whole QLoRA step at Qwen2.5-0.5B's shapes 0.96x the time (2 CPU cores)."""
        compute = jnp.dtype(self.compute_dtype)
        tokens = math.prod(x.shape[: x.ndim - self.in_rank])
        return (
            self.lora is not None
            and cpu_products()
            and compute.itemsize == 2
            and jnp.dtype(self.lora.dtype or x.dtype) == compute
            and tokens > 1
        )

    def _adapted(self, x: jax.Array, kernel: Any, deterministic: bool, ctx: nnx.Context | None) -> jax.Array:
        compute, fan_in = self.compute_dtype, math.prod(x.shape[x.ndim - self.in_rank :])
        if isinstance(kernel, nnx.QuantizedKernel):
            weight, source = functools.partial(dequantize_kernel, type=kernel.type, dtype=compute), kernel.parts()
        else:
            weight, source = functools.partial(_frozen_weight, fan_in=fan_in, compute=compute), kernel
        out = self.out_dtype or self.dtype
        x = x.astype(compute)
        return self.lora.adapt(
            x, weight, source, trainable=not self.frozen, out_dtype=out, deterministic=deterministic, ctx=ctx
        )
