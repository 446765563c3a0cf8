"""Linear layers: :class:`Linear`, :class:`Conv` and :class:`Embed`.

Parameter shapes, defaults and numerics follow ``flax.linen`` (``Dense``,
``Conv`` and ``Embed``), so parameters can be moved between the two.
"""

from __future__ import annotations

import typing as tp
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from nnx import containers
from nnx.contextlib import Context
from nnx.module import Module
from nnx.nn import dtypes, initializers
from nnx.nn._options import freeze

Array = jax.Array
Dtype = tp.Any
Shape = tp.Sequence[int]
PrecisionLike = tp.Union[None, str, lax.Precision, tuple[str, str], tuple[lax.Precision, lax.Precision]]  # noqa: UP007 (a runtime alias)
PaddingLike = tp.Union[str, int, Sequence[int | tuple[int, int]]]  # noqa: UP007 (a runtime alias)
LaxPadding = tp.Union[str, Sequence[tuple[int, int]]]  # noqa: UP007 (a runtime alias)
DotGeneralT = tp.Callable[..., Array]

default_kernel_init = initializers.lecun_normal()
default_embed_init = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def _kernel_and_bias(
    kernel_init: initializers.Initializer,
    bias_init: initializers.Initializer,
    kernel_shape: Shape,
    use_bias: bool,
    param_dtype: Dtype,
    ctx: Context,
) -> tuple[containers.Param, containers.Param]:
    """``Param(kernel)`` and ``Param(bias)`` of shape ``kernel_shape[-1:]``, or ``Param(None)`` without bias."""
    kernel = containers.Param(initializers.draw(kernel_init, "kernel_init", ctx, kernel_shape, param_dtype))
    if not use_bias:
        return kernel, containers.Param(None)
    return kernel, containers.Param(initializers.draw(bias_init, "bias_init", ctx, kernel_shape[-1:], param_dtype))


def _add_bias(y: Array, bias: Array | None) -> Array:
    """``y + bias`` along the last axis (``y`` itself without bias)."""
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


class Linear(Module):
    """A linear map ``y = x @ kernel + bias`` over the last axis of the input.

    The counterpart of ``flax.linen.Dense``: ``kernel`` has shape
    ``(in_features, out_features)`` and ``bias`` shape ``(out_features,)``; both
    are :class:`~nnx.Param`. With ``use_bias=False`` the ``bias`` attribute is
    ``Param(None)``.

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> layer = nnx.Linear(3, 4, ctx=nnx.context(0))
      >>> layer.kernel.shape, layer.bias.shape
      ((3, 4), (4,))
      >>> layer(jnp.ones((2, 3))).shape
      (2, 4)

    To annotate the kernel with logical axes for sharding, wrap its initializer::

      >>> layer = nnx.Linear(
      ...   3, 4,
      ...   kernel_init=nnx.with_metadata(
      ...     nnx.initializers.lecun_normal(), sharding=("din", "dout")
      ...   ),
      ...   ctx=nnx.context(0),
      ... )

    Args:
      in_features: size of the last axis of the input.
      out_features: size of the last axis of the output.
      use_bias: whether to add a learned bias.
      dtype: computation dtype; ``None`` infers it from the input and params.
      param_dtype: dtype the parameters are initialised in.
      precision: numerical precision of the matmul, see ``jax.lax.Precision``.
      kernel_init: initializer of the kernel (default ``lecun_normal()``).
      bias_init: initializer of the bias (default ``zeros()``).
      dot_general: the contraction to use, with ``lax.dot_general``'s signature.
      ctx: the :class:`~nnx.Context`; its ``params`` stream initialises weights.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: initializers.Initializer = default_kernel_init,
        bias_init: initializers.Initializer = initializers.zeros(),
        dot_general: DotGeneralT = lax.dot_general,
        ctx: Context,
    ):
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.kernel_init = kernel_init
        self.bias_init = bias_init
        self.dot_general = dot_general

        self.kernel, self.bias = _kernel_and_bias(
            kernel_init, bias_init, (in_features, out_features), use_bias, param_dtype, ctx
        )

    def __call__(self, inputs: Array) -> Array:
        """Applies the linear map to the last axis of ``inputs``."""
        inputs = jnp.asarray(inputs)
        if inputs.ndim == 0 or inputs.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear expects inputs whose last axis has size in_features="
                f"{self.in_features}, got shape {inputs.shape}."
            )
        inputs, kernel, bias = dtypes.promote_dtype(inputs, self.kernel, self.bias, dtype=self.dtype)
        y = self.dot_general(
            inputs,
            kernel,
            (((inputs.ndim - 1,), (0,)), ((), ())),
            precision=self.precision,
        )
        y = _add_bias(y, bias)
        return y


def _conv_dimension_numbers(input_shape: Shape) -> lax.ConvDimensionNumbers:
    """Dimension numbers for channels-last inputs and ``(*window, in, out)`` kernels."""
    ndim = len(input_shape)
    lhs_spec = (0, ndim - 1) + tuple(range(1, ndim - 1))
    rhs_spec = (ndim - 1, ndim - 2) + tuple(range(0, ndim - 2))
    return lax.ConvDimensionNumbers(lhs_spec, rhs_spec, lhs_spec)


def canonicalize_padding(padding: PaddingLike, rank: int) -> LaxPadding:
    """Turns a user padding spec into a string or ``rank`` ``(low, high)`` pairs.

    Accepts a string (``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, ...), one int
    (the same padding on both sides of every spatial axis), or a sequence of
    ``rank`` entries, each an int or a ``(low, high)`` pair.
    """
    if isinstance(padding, str):
        return padding
    if isinstance(padding, int):
        return [(padding, padding)] * rank
    if isinstance(padding, Sequence) and len(padding) == rank:
        pairs: list[tuple[int, int]] = []
        for p in padding:
            if isinstance(p, int):
                pairs.append((p, p))
            elif isinstance(p, (tuple, list)) and len(p) == 2:
                pairs.append((int(p[0]), int(p[1])))
            else:
                break
        if len(pairs) == rank:
            return pairs
    raise ValueError(
        f"Invalid padding {padding!r}: expected a string, an int, or a sequence "
        f"of {rank} entries (one per spatial axis), each an int or a (low, high) "
        "pair of ints."
    )


def _as_tuple(x: int | Sequence[int] | None, rank: int) -> tuple[int, ...]:
    if x is None:
        x = 1
    if isinstance(x, int):
        return (x,) * rank
    return tuple(x)


class Conv(Module):
    """An N-d convolution over channels-last inputs (``lax.conv_general_dilated``).

    The counterpart of ``flax.linen.Conv``. Inputs have shape
    ``(*batch, *spatial, in_features)``; several batch axes are flattened for
    the convolution and restored afterwards, and an unbatched input
    ``(*spatial, in_features)`` is accepted too. ``kernel`` has shape
    ``kernel_size + (in_features // feature_group_count, out_features)`` and
    ``bias`` shape ``(out_features,)``.

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> conv = nnx.Conv(3, 8, kernel_size=(3, 3), ctx=nnx.context(0))
      >>> conv.kernel.shape
      (3, 3, 3, 8)
      >>> conv(jnp.ones((2, 16, 16, 3))).shape
      (2, 16, 16, 8)
      >>> nnx.Conv(3, 8, 3, strides=2, padding="VALID", ctx=nnx.context(0))(
      ...   jnp.ones((9, 3))
      ... ).shape
      (4, 8)

    Args:
      in_features: number of input channels.
      out_features: number of output channels (filters).
      kernel_size: window shape; an int means a 1-d window.
      strides: an int or one int per spatial axis (default 1).
      padding: ``"SAME"``, ``"VALID"``, ``"CIRCULAR"`` (periodic),
        ``"REFLECT"``, ``"CAUSAL"`` (1-d only), an int, or a sequence of ints or
        ``(low, high)`` pairs, one per spatial axis.
      input_dilation: an int or one int per spatial axis; dilating the input by
        ``d`` is a transposed convolution with stride ``d``.
      kernel_dilation: an int or one int per spatial axis ("atrous" conv).
      feature_group_count: split the input channels into this many groups.
      use_bias: whether to add a learned bias.
      mask: optional array with the kernel's shape, multiplied into the kernel
        on every call (masked convolution). It is kept as a plain array
        attribute, so it is part of the module's state (filter ``nnx.buffers``)
        and travels through ``jit`` with the parameters.
      dtype: computation dtype; ``None`` infers it from the input and params.
      param_dtype: dtype the parameters are initialised in.
      precision: numerical precision, see ``jax.lax.Precision``.
      kernel_init: initializer of the kernel (default ``lecun_normal()``).
      bias_init: initializer of the bias (default ``zeros()``).
      ctx: the :class:`~nnx.Context`; its ``params`` stream initialises weights.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] | None = 1,
        padding: PaddingLike = "SAME",
        input_dilation: int | Sequence[int] | None = 1,
        kernel_dilation: int | Sequence[int] | None = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        mask: Array | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: initializers.Initializer = default_kernel_init,
        bias_init: initializers.Initializer = initializers.zeros(),
        *,
        ctx: Context,
    ):
        if isinstance(kernel_size, int):
            kernel_size = (kernel_size,)
        else:
            kernel_size = tuple(kernel_size)
        if in_features % feature_group_count != 0:
            raise ValueError(
                f"in_features ({in_features}) must be divisible by feature_group_count ({feature_group_count})."
            )
        kernel_shape = kernel_size + (in_features // feature_group_count, out_features)
        if mask is not None and tuple(mask.shape) != kernel_shape:
            raise ValueError(
                "The mask must have the same shape as the kernel: got mask shape "
                f"{tuple(mask.shape)}, kernel shape {kernel_shape}."
            )

        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = kernel_size
        self.strides = freeze(strides)
        self.padding = freeze(padding)
        self.input_dilation = freeze(input_dilation)
        self.kernel_dilation = freeze(kernel_dilation)
        self.feature_group_count = feature_group_count
        self.use_bias = use_bias
        self.mask = mask
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.kernel_init = kernel_init
        self.bias_init = bias_init

        self.kernel, self.bias = _kernel_and_bias(kernel_init, bias_init, kernel_shape, use_bias, param_dtype, ctx)

    def __call__(self, inputs: Array) -> Array:
        """Convolves ``inputs`` of shape ``(*batch, *spatial, in_features)``."""
        inputs = jnp.asarray(inputs)
        kernel_size = self.kernel_size
        rank = len(kernel_size)

        # Fold all batch axes (zero, one or many) into a single leading axis.
        num_batch_axes = inputs.ndim - (rank + 1)
        if num_batch_axes < 0:
            raise ValueError(
                f"Conv with a {rank}-d kernel expects inputs of shape "
                f"(*batch, *spatial[{rank}], features), got shape {inputs.shape}."
            )
        if inputs.shape[-1] != self.in_features:
            raise ValueError(
                f"Conv expects inputs whose last (channel) axis has size in_features="
                f"{self.in_features}, got shape {inputs.shape}."
            )
        batch_shape = inputs.shape[:num_batch_axes]
        if num_batch_axes != 1:
            inputs = jnp.reshape(inputs, (-1,) + inputs.shape[num_batch_axes:])

        strides = _as_tuple(self.strides, rank)
        input_dilation = _as_tuple(self.input_dilation, rank)
        kernel_dilation = _as_tuple(self.kernel_dilation, rank)

        padding = canonicalize_padding(self.padding, rank)
        if padding in ("CIRCULAR", "REFLECT"):
            dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
            pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
            mode = "wrap" if padding == "CIRCULAR" else "reflect"
            inputs = jnp.pad(inputs, pads, mode=mode)
            padding = "VALID"
        elif padding == "CAUSAL":
            if rank != 1:
                raise ValueError("Causal padding is only implemented for 1-d convolutions.")
            left = kernel_dilation[0] * (kernel_size[0] - 1)
            inputs = jnp.pad(inputs, [(0, 0), (left, 0), (0, 0)])
            padding = "VALID"

        kernel = self.kernel
        if self.mask is not None:
            kernel = kernel * self.mask

        inputs, kernel, bias = dtypes.promote_dtype(inputs, kernel, self.bias, dtype=self.dtype)
        y = lax.conv_general_dilated(
            inputs,
            kernel,
            strides,
            padding,
            lhs_dilation=input_dilation,
            rhs_dilation=kernel_dilation,
            dimension_numbers=_conv_dimension_numbers(inputs.shape),
            feature_group_count=self.feature_group_count,
            precision=self.precision,
        )
        y = _add_bias(y, bias)

        if num_batch_axes != 1:
            y = jnp.reshape(y, batch_shape + y.shape[1:])
        return y


class Embed(Module):
    """A lookup table from integers ``[0, num_embeddings)`` to feature vectors.

    The counterpart of ``flax.linen.Embed``. ``embedding`` is a
    :class:`~nnx.Param` of shape ``(num_embeddings, features)``. Calling the
    layer gathers rows; :meth:`attend` computes the inner product of queries
    with every row (e.g. to share the embedding with the output logits).

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> embed = nnx.Embed(10, 4, ctx=nnx.context(0))
      >>> embed(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)
      >>> embed.attend(jnp.ones((5, 4))).shape
      (5, 10)

    Args:
      num_embeddings: vocabulary size.
      features: size of each embedding vector.
      dtype: dtype of the returned embeddings; ``None`` keeps the param dtype.
      param_dtype: dtype the table is initialised in.
      embedding_init: initializer of the table (default
        ``variance_scaling(1.0, "fan_in", "normal", out_axis=0)``).
      ctx: the :class:`~nnx.Context`; its ``params`` stream initialises weights.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        embedding_init: initializers.Initializer = default_embed_init,
        ctx: Context,
    ):
        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.embedding_init = embedding_init
        self.embedding = containers.Param(
            initializers.draw(embedding_init, "embedding_init", ctx, (num_embeddings, features), param_dtype)
        )

    def __call__(self, inputs: Array) -> Array:
        """Looks up ``inputs`` (integers, any shape); appends a ``features`` axis.

        As in ``flax.linen``, out-of-range indices give ``nan`` rows. The rows
        are taken from the stored table, then converted to ``dtype`` (the same
        values as converting the table first): the table's gradient sums the
        rows' gradients in the parameter's dtype, so a token repeated
        thousands of times in a ``bfloat16`` batch is not summed in 16 bits.
        """
        inputs = jnp.asarray(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(
                "Input type must be an integer or unsigned integer, got "
                f"{inputs.dtype}. Embed looks up integer indices; cast them with "
                "x.astype(jnp.int32)."
            )
        if self.num_embeddings == 1:
            (embedding,) = dtypes.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
            return jnp.broadcast_to(embedding, inputs.shape + (self.features,))
        (rows,) = dtypes.promote_dtype(jnp.take(self.embedding, inputs, axis=0), dtype=self.dtype, inexact=False)
        return rows

    def attend(self, query: Array) -> Array:
        """Inner products of ``query`` (last axis ``features``) with every row.

        Returns an array whose last axis has size ``num_embeddings``.
        """
        query, embedding = dtypes.promote_dtype(query, self.embedding, dtype=self.dtype)
        return jnp.dot(query, embedding.T)
