"""Normalization layers: :class:`BatchNorm` and :class:`LayerNorm`.

Numerics follow ``flax.linen``: statistics are computed in at least float32
with the one-pass formula ``var = E[|x|^2] - |E[x]|^2`` (clipped at zero), and
``y = (x - mean) * rsqrt(var + epsilon) * scale + bias``.
"""

from __future__ import annotations

import math
import typing as tp
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from jax import lax

from nnx import containers
from nnx.contextlib import Context
from nnx.module import Module
from nnx.nn import dtypes, initializers
from nnx.nn._options import freeze, resolve_flag

Array = jax.Array
Dtype = tp.Any
Axes = tp.Union[int, tp.Sequence[int]]  # noqa: UP007 (a runtime alias)


def _canonicalize_axes(rank: int, axes: Axes) -> tuple[int, ...]:
    """Sorted, deduplicated, non-negative axes."""
    if not isinstance(axes, Iterable):
        axes = (axes,)
    return tuple(sorted({axis + rank if axis < 0 else axis for axis in axes}))


def _abs_sq(x: Array) -> Array:
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def _compute_stats(
    x: Array,
    axes: Axes,
    dtype: Dtype | None,
    axis_name: str | None = None,
    axis_index_groups: tp.Any = None,
) -> tuple[Array, Array]:
    """Mean and variance of ``x`` over ``axes``, in at least float32.

    With ``axis_name`` the first and second moments are averaged over that
    named (``pmap``/``shard_map``/``vmap``) axis in a single ``pmean``.
    """
    dtype = jnp.promote_types(jnp.result_type(x) if dtype is None else dtype, jnp.float32)
    x = jnp.asarray(x, dtype)
    axes = _canonicalize_axes(x.ndim, axes)
    mean = jnp.mean(x, axes)
    mean_sq = jnp.mean(_abs_sq(x), axes)
    if axis_name is not None:
        both = lax.pmean(jnp.stack([mean, mean_sq]), axis_name, axis_index_groups=axis_index_groups)
        mean, mean_sq = both[0], both[1]
    var = jnp.maximum(0.0, mean_sq - _abs_sq(mean))
    return mean, var


def _normalize(
    x: Array,
    mean: Array,
    var: Array,
    scale: Array | None,
    bias: Array | None,
    reduction_axes: Axes,
    feature_axes: Axes,
    dtype: Dtype | None,
    epsilon: float,
) -> Array:
    """``(x - mean) * rsqrt(var + epsilon) * scale + bias``, cast to ``dtype``.

    ``mean``/``var`` have ``x``'s shape without ``reduction_axes``; ``scale``
    and ``bias`` hold as many elements as the ``feature_axes`` of ``x``.
    """
    reduction_axes = _canonicalize_axes(x.ndim, reduction_axes)
    feature_axes = _canonicalize_axes(x.ndim, feature_axes)
    feature_shape = [1] * x.ndim
    for ax in feature_axes:
        feature_shape[ax] = x.shape[ax]

    mean = jnp.expand_dims(mean, reduction_axes)
    var = jnp.expand_dims(var, reduction_axes)
    y = x - mean
    mul = lax.rsqrt(var + epsilon)
    args = [x]
    if scale is not None:
        scale = jnp.reshape(scale, feature_shape)
        mul *= scale
        args.append(scale)
    y *= mul
    if bias is not None:
        bias = jnp.reshape(bias, feature_shape)
        y += bias
        args.append(bias)
    return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=dtype))


def _feature_params(
    num_features: int,
    use_scale: bool,
    use_bias: bool,
    scale_init: initializers.Initializer,
    bias_init: initializers.Initializer,
    param_dtype: Dtype,
    ctx: Context,
) -> tuple[containers.Param, containers.Param]:
    shape = (num_features,)
    scale = containers.Param(
        initializers.draw(scale_init, "scale_init", ctx, shape, param_dtype) if use_scale else None
    )
    bias = containers.Param(initializers.draw(bias_init, "bias_init", ctx, shape, param_dtype) if use_bias else None)
    return scale, bias


class BatchNorm(Module):
    """Batch normalization (Ioffe & Szegedy, 2015), like ``flax.linen.BatchNorm``.

    In training mode (``use_running_average=False``) the input is normalized
    with the statistics of the current batch (all axes but ``axis``) and the
    running statistics are updated in place::

      mean <- momentum * mean + (1 - momentum) * batch_mean
      var  <- momentum * var  + (1 - momentum) * batch_var

    In evaluation mode (``use_running_average=True``) the running statistics
    are used and nothing is updated. The mode is the first non-``None`` of the
    ``use_running_average`` call argument, the attribute of the same name, and
    the ``use_running_average`` flag of the ``ctx`` passed to the call.

    ``scale`` and ``bias`` are :class:`~nnx.Param`, the running ``mean`` and
    ``var`` are :class:`~nnx.BatchStat`, all of shape ``(num_features,)``.
    With several feature axes (``axis=(1, 2)``), ``num_features`` is the
    number of elements they hold together and the four arrays are flat (as
    in :class:`LayerNorm`; ``flax.linen`` gives them the axes' shape).

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> bn = nnx.BatchNorm(3, ctx=nnx.context(0))
      >>> x = jnp.arange(12.0).reshape(4, 3)
      >>> y = bn(x, use_running_average=False)   # updates bn.mean / bn.var
      >>> y = bn(x, ctx=nnx.context(flags={"use_running_average": True}))
      >>> (state, batch_stats), moduledef = bn.partition(nnx.Param, nnx.BatchStat)

    Args:
      num_features: size of the feature axis ``axis`` (the product of the
        sizes when ``axis`` names several).
      use_running_average: default mode (see above); ``None`` leaves it to the
        call.
      axis: the feature axis or axes; every other axis is reduced.
      momentum: decay of the running averages.
      epsilon: added to the variance for numerical stability.
      dtype: dtype of the result; ``None`` infers it from input and params.
      param_dtype: dtype the parameters are initialised in.
      use_bias: learn a bias (beta).
      use_scale: learn a scale (gamma).
      bias_init: initializer of the bias (default ``zeros()``).
      scale_init: initializer of the scale (default ``ones()``).
      axis_name: name of a mapped axis (``pmap``, ``shard_map``, ``vmap``) to
        average the batch statistics over.
      axis_index_groups: subgroups of ``axis_name`` to average within, see
        ``jax.lax.psum``.
      ctx: the :class:`~nnx.Context`; its ``params`` stream initialises params.
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = None,
        axis: Axes = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: initializers.Initializer = initializers.zeros(),
        scale_init: initializers.Initializer = initializers.ones(),
        axis_name: str | None = None,
        axis_index_groups: tp.Any = None,
        ctx: Context,
    ):
        self.num_features = num_features
        self.use_running_average = use_running_average
        self.axis = freeze(axis)
        self.momentum = momentum
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.bias_init = bias_init
        self.scale_init = scale_init
        self.axis_name = axis_name
        self.axis_index_groups = freeze(axis_index_groups)

        self.mean = containers.BatchStat(jnp.zeros((num_features,), jnp.float32))
        self.var = containers.BatchStat(jnp.ones((num_features,), jnp.float32))
        self.scale, self.bias = _feature_params(
            num_features, use_scale, use_bias, scale_init, bias_init, param_dtype, ctx
        )

    def __call__(
        self,
        x: Array,
        *,
        use_running_average: bool | None = None,
        ctx: Context | None = None,
    ) -> Array:
        """Normalizes ``x``; in training mode also updates ``mean`` and ``var``.

        Args:
          x: input whose ``axis`` has size ``num_features``.
          use_running_average: overrides the attribute and the context flag.
          ctx: optional context whose ``use_running_average`` flag is used when
            neither the argument nor the attribute is set.
        """
        use_running_average = resolve_flag(
            "use_running_average",
            use_running_average,
            self.use_running_average,
            ctx,
            "BatchNorm needs to know whether to use the running statistics: pass "
            "`use_running_average=True/False` to the call or to the constructor, "
            "or pass a context with the flag, e.g. "
            "`ctx=nnx.context(flags={'use_running_average': False})`.",
        )

        feature_axes = _canonicalize_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        feature_shape = tuple(x.shape[i] for i in feature_axes)
        if math.prod(feature_shape) != self.num_features:
            raise ValueError(
                f"BatchNorm(num_features={self.num_features}, axis={self.axis}) got an input of shape {x.shape}, "
                f"whose feature axes {feature_axes} hold {math.prod(feature_shape)} elements: build the layer "
                f"with num_features={math.prod(feature_shape)}, or pass the feature axes as axis=."
            )

        if use_running_average:
            # The running statistics are flat; the batch's have the feature axes' shape.
            mean, var = jnp.reshape(self.mean, feature_shape), jnp.reshape(self.var, feature_shape)
        else:
            mean, var = _compute_stats(
                x,
                reduction_axes,
                dtype=self.dtype,
                axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups,
            )
            momentum = self.momentum
            self.mean = momentum * self.mean + (1 - momentum) * jnp.reshape(mean, (-1,))
            self.var = momentum * self.var + (1 - momentum) * jnp.reshape(var, (-1,))

        return _normalize(
            x,
            mean,
            var,
            self.scale,
            self.bias,
            reduction_axes,
            feature_axes,
            self.dtype,
            self.epsilon,
        )


class LayerNorm(Module):
    """Layer normalization (Ba et al., 2016), like ``flax.linen.LayerNorm``.

    Each example is normalized over ``reduction_axes`` (by default the last
    axis), then scaled and shifted by learned ``scale`` and ``bias`` of shape
    ``(num_features,)`` laid out along ``feature_axes``.

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> ln = nnx.LayerNorm(6, ctx=nnx.context(0))
      >>> ln(jnp.ones((2, 6))).shape
      (2, 6)

    Args:
      num_features: number of elements of the ``feature_axes`` of the input.
      epsilon: added to the variance for numerical stability.
      dtype: dtype of the result; ``None`` infers it from input and params.
      param_dtype: dtype the parameters are initialised in.
      use_bias: learn a bias (beta).
      use_scale: learn a scale (gamma).
      bias_init: initializer of the bias (default ``zeros()``).
      scale_init: initializer of the scale (default ``ones()``).
      reduction_axes: axes to compute the statistics over.
      feature_axes: axes the scale and bias are laid out along.
      axis_name: name of a mapped axis to average the statistics over, for
        inputs split across devices.
      axis_index_groups: subgroups of ``axis_name``, see ``jax.lax.psum``.
      ctx: the :class:`~nnx.Context`; its ``params`` stream initialises params.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: initializers.Initializer = initializers.zeros(),
        scale_init: initializers.Initializer = initializers.ones(),
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: tp.Any = None,
        ctx: Context,
    ):
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.bias_init = bias_init
        self.scale_init = scale_init
        self.reduction_axes = freeze(reduction_axes)
        self.feature_axes = freeze(feature_axes)
        self.axis_name = axis_name
        self.axis_index_groups = freeze(axis_index_groups)

        self.scale, self.bias = _feature_params(
            num_features, use_scale, use_bias, scale_init, bias_init, param_dtype, ctx
        )

    def __call__(self, x: Array) -> Array:
        """Normalizes ``x`` over ``reduction_axes``."""
        if self.use_scale or self.use_bias:
            feature_axes = _canonicalize_axes(x.ndim, self.feature_axes)
            features = math.prod(x.shape[i] for i in feature_axes)
            if features != self.num_features:
                raise ValueError(
                    f"LayerNorm(num_features={self.num_features}, feature_axes={self.feature_axes}) got an input of "
                    f"shape {x.shape}, whose feature axes {feature_axes} hold {features} elements: build the layer "
                    f"with num_features={features}, or pass the feature axes as feature_axes=."
                )
        mean, var = _compute_stats(
            x,
            self.reduction_axes,
            self.dtype,
            self.axis_name,
            self.axis_index_groups,
        )
        return _normalize(
            x,
            mean,
            var,
            containers.stored_value(self, "scale"),  # not constrained: a scan would stack it again
            containers.stored_value(self, "bias"),
            self.reduction_axes,
            self.feature_axes,
            self.dtype,
            self.epsilon,
        )
