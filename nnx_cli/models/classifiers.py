"""`mlp_classifier` and `cnn_classifier`: image classifiers with `loss` and `accuracy` metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

import nnx
from nnx_cli.errors import UserError
from nnx_cli.models.layers import check_rate, check_sizes, hidden_axes, linear, mlp

Batch = dict[str, jax.Array]


class _Classifier(nnx.Module):
    loss_metric = "loss"
    needs_labels = True

    def logits(self, x: jax.Array, ctx: nnx.Context) -> jax.Array:
        raise NotImplementedError

    def metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        logits = self.logits(batch["image"], ctx)
        labels = batch["label"]
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
            "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
        }


def _require_classes(num_classes: int | None, name: str) -> int:
    if not num_classes:
        raise UserError(f"model {name!r} needs labels: set data.label_key to the label column, or model.num_classes")
    return num_classes


class MLPClassifier(_Classifier):
    """Flatten, `Linear -> relu -> Dropout` per hidden size, then a linear readout.

    Args:
        input_shape: one image's shape (flattened).
        num_classes: the number of labels.
        hidden_sizes: the hidden widths.
        dropout: dropout after each hidden layer.
        ctx: the `params` RNG stream.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int | None = None,
        *,
        hidden_sizes: Sequence[int] = (256,),
        dropout: float = 0.1,
        ctx: nnx.Context,
    ):
        classes = _require_classes(num_classes, "mlp_classifier")
        hidden = check_sizes("hidden_sizes", hidden_sizes)
        check_rate("dropout", dropout)
        sizes, axes = [math.prod(input_shape), *hidden], ["embed", *hidden_axes(len(hidden))]
        self.hidden = mlp(sizes, axes, ctx)
        self.dropout = nnx.Dropout(dropout)
        self.head = linear(sizes[-1], classes, (axes[-1], "classes"), ctx)

    def logits(self, x: jax.Array, ctx: nnx.Context) -> jax.Array:
        h = x.reshape(x.shape[0], -1)
        for layer in self.hidden:
            h = self.dropout(jax.nn.relu(layer(h)), ctx=ctx)
        return self.head(h)


class CNNClassifier(_Classifier):
    """`Conv 3x3 -> BatchNorm -> relu -> 2x2 average pool` per feature size, then Dropout and an MLP head.

    Args:
        input_shape: one image's shape, `[height, width, channels]`.
        num_classes: the number of labels.
        features: the channels of each convolution stage.
        hidden_size: the head's hidden width.
        dropout: dropout before and inside the head.
        ctx: the `params` RNG stream.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int | None = None,
        *,
        features: Sequence[int] = (32, 64),
        hidden_size: int = 128,
        dropout: float = 0.3,
        ctx: nnx.Context,
    ):
        classes = _require_classes(num_classes, "cnn_classifier")
        if len(input_shape) != 3:
            raise UserError(
                f"model 'cnn_classifier' needs images [height, width, channels], got input shape {list(input_shape)}"
            )
        height, width, channels = input_shape
        check_sizes("hidden_size", [hidden_size], one=True)
        check_rate("dropout", dropout)
        convs, norms = [], []
        for f in check_sizes("features", features):
            convs.append(
                nnx.Conv(
                    channels,
                    f,
                    (3, 3),
                    kernel_init=nnx.with_logical_partitioning(
                        nnx.initializers.lecun_normal(), ("conv_height", "conv_width", "channels", "hidden")
                    ),
                    bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), ("hidden",)),
                    ctx=ctx,
                )
            )
            norms.append(
                nnx.BatchNorm(
                    f,
                    scale_init=nnx.with_logical_partitioning(nnx.initializers.ones(), ("hidden",)),
                    bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), ("hidden",)),
                    ctx=ctx,
                )
            )
            channels, height, width = f, height // 2, width // 2
        if height < 1 or width < 1:
            raise UserError(
                f"model 'cnn_classifier': {len(features)} pooling stages shrink a {input_shape[0]}x{input_shape[1]} "
                "image to nothing; use fewer model.features"
            )
        self.convs = nnx.Sequence(convs)
        self.norms = nnx.Sequence(norms)
        self.dropout = nnx.Dropout(dropout)
        self.hidden = linear(height * width * channels, hidden_size, ("embed", "hidden"), ctx)
        self.head = linear(hidden_size, classes, ("hidden", "classes"), ctx)

    def logits(self, x: jax.Array, ctx: nnx.Context) -> jax.Array:
        for conv, norm in zip(self.convs, self.norms):
            x = jax.nn.relu(norm(conv(x), ctx=ctx))
            x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
        h = self.dropout(x.reshape(x.shape[0], -1), ctx=ctx)
        return self.head(self.dropout(jax.nn.relu(self.hidden(h)), ctx=ctx))
