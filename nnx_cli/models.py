"""The model registry: `model.name` -> an `nnx.Module` that knows its metrics.

A trainable model is an `nnx.Module` built as
`Model(input_shape, num_classes, *, <options>, ctx)` with

- `metrics(batch, ctx) -> {name: per-example array}`: training minimises the
  batch mean of `metrics[Model.loss_metric]`; evaluation averages every entry
  over the eval split;
- optionally `images(batch, ctx) -> [N, H, W, C]` in `[0, 1]`: written as a
  PNG grid at each eval.

`ctx` carries the `sample` and `dropout` RNG streams and the `deterministic`
and `use_running_average` flags (False while training, True in eval).

Every parameter declares logical axes (`embed`: flattened input pixels,
`hidden` / `mlp`: hidden units of alternate layers, `latent`, `classes`,
conv `channels` and spatial axes), so a mesh
shards the model by changing `sharding.rules` only. `model.name` may also be
`"package.module:Class"` for a class following the same protocol.
"""

from __future__ import annotations

import importlib
import inspect as _pyinspect
import itertools
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import nnx
from nnx_cli.config import ModelConfig, check_type
from nnx_cli.data import DataSpec
from nnx_cli.errors import UserError, did_you_mean

Batch = dict[str, jax.Array]


def _linear(din: int, dout: int, axes: tuple[str, str], ctx: nnx.Context) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        kernel_init=nnx.with_logical_partitioning(nnx.initializers.lecun_normal(), axes),
        bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), (axes[1],)),
        ctx=ctx,
    )


def _hidden_axes(count: int) -> list[str]:
    """Logical names of consecutive hidden layers: `hidden`, `mlp`, `hidden`, ... so that
    no kernel names one axis twice (hidden-to-hidden kernels are `(hidden, mlp)`)."""
    return [("hidden", "mlp")[i % 2] for i in range(count)]


def _mlp(sizes: Sequence[int], axes: Sequence[str], ctx: nnx.Context) -> nnx.Sequence:
    """Linear layers `sizes[0] -> sizes[1] -> ...`; layer i has axes `(axes[i], axes[i + 1])`."""
    return nnx.Sequence(
        [_linear(a, b, (axes[i], axes[i + 1]), ctx) for i, (a, b) in enumerate(itertools.pairwise(sizes))]
    )


class VAE(nnx.Module):
    """A variational autoencoder with MLP encoder/decoder and a Bernoulli decoder.

    Metrics, in nats per example: `recon` (Bernoulli negative log-likelihood),
    `kl` (KL(q(z|x) || N(0, I))) and `nelbo = recon + kl`, the single-sample
    negative ELBO that training minimises.
    """

    loss_metric = "nelbo"

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int | None = None,
        *,
        hidden_sizes: Sequence[int] = (512,),
        latent_size: int = 32,
        ctx: nnx.Context,
    ):
        self.input_shape = tuple(input_shape)
        self.latent_size = latent_size
        pixels = math.prod(input_shape)
        hidden = _sizes("hidden_sizes", hidden_sizes)
        _sizes("latent_size", [latent_size])
        sizes, axes = [pixels, *hidden], ["embed", *_hidden_axes(len(hidden))]
        self.encoder = _mlp(sizes, axes, ctx)
        self.mean = _linear(sizes[-1], latent_size, (axes[-1], "latent"), ctx)
        self.logvar = _linear(sizes[-1], latent_size, (axes[-1], "latent"), ctx)
        self.decoder = _mlp(
            [latent_size, *reversed(hidden), pixels], ["latent", *_hidden_axes(len(hidden)), "embed"], ctx
        )

    def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = x.reshape(x.shape[0], -1)
        for layer in self.encoder:
            h = jax.nn.relu(layer(h))
        return self.mean(h), self.logvar(h)

    def decode(self, z: jax.Array) -> jax.Array:
        """Bernoulli logits, shaped like the input."""
        *hidden, out = list(self.decoder)
        h = z
        for layer in hidden:
            h = jax.nn.relu(layer(h))
        return out(h).reshape(z.shape[0], *self.input_shape)

    def metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        x = batch["image"]
        mean, logvar = self.encode(x)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(ctx.make_rng("sample"), mean.shape)
        logits = self.decode(z)
        recon = optax.sigmoid_binary_cross_entropy(logits, x).reshape(x.shape[0], -1).sum(-1)
        kl = 0.5 * jnp.sum(jnp.exp(logvar) + mean**2 - 1.0 - logvar, axis=-1)
        return {"nelbo": recon + kl, "recon": recon, "kl": kl}

    def images(self, batch: Batch, ctx: nnx.Context) -> jax.Array:
        """Rows: 8 inputs, their reconstructions (posterior mean), 16 samples from the prior."""
        x = batch["image"][:8]
        mean, _ = self.encode(x)
        recon = jax.nn.sigmoid(self.decode(mean))
        samples = jax.nn.sigmoid(self.decode(jax.random.normal(ctx.make_rng("sample"), (16, self.latent_size))))
        return jnp.concatenate([x, recon, samples])


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


def _sizes(option: str, sizes: Sequence[int]) -> list[int]:
    """Layer sizes must be positive: a zero-width layer has nothing to learn."""
    if any(size < 1 for size in sizes):
        raise ValueError(f"model.{option} must hold positive sizes, got {list(sizes)}")
    return list(sizes)


def _rate(option: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"model.{option} is a drop probability in [0, 1), got {rate}")


def _require_classes(num_classes: int | None, name: str) -> int:
    if not num_classes:
        raise UserError(f"model {name!r} needs labels: set data.label_key to the label column, or model.num_classes")
    return num_classes


class MLPClassifier(_Classifier):
    """Flatten, `Linear -> relu -> Dropout` per hidden size, then a linear readout."""

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
        hidden = _sizes("hidden_sizes", hidden_sizes)
        _rate("dropout", dropout)
        sizes, axes = [math.prod(input_shape), *hidden], ["embed", *_hidden_axes(len(hidden))]
        self.hidden = _mlp(sizes, axes, ctx)
        self.dropout = nnx.Dropout(dropout)
        self.head = _linear(sizes[-1], classes, (axes[-1], "classes"), ctx)

    def logits(self, x: jax.Array, ctx: nnx.Context) -> jax.Array:
        h = x.reshape(x.shape[0], -1)
        for layer in self.hidden:
            h = self.dropout(jax.nn.relu(layer(h)), ctx=ctx)
        return self.head(h)


class CNNClassifier(_Classifier):
    """`Conv 3x3 -> BatchNorm -> relu -> 2x2 average pool` per feature size, then Dropout and an MLP head."""

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
        _sizes("hidden_size", [hidden_size])
        _rate("dropout", dropout)
        convs, norms = [], []
        for f in _sizes("features", features):
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
        self.hidden = _linear(height * width * channels, hidden_size, ("embed", "hidden"), ctx)
        self.head = _linear(hidden_size, classes, ("hidden", "classes"), ctx)

    def logits(self, x: jax.Array, ctx: nnx.Context) -> jax.Array:
        for conv, norm in zip(self.convs, self.norms):
            x = jax.nn.relu(norm(conv(x), ctx=ctx))
            x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
        h = self.dropout(x.reshape(x.shape[0], -1), ctx=ctx)
        return self.head(self.dropout(jax.nn.relu(self.hidden(h)), ctx=ctx))


REGISTRY: dict[str, type] = {"vae": VAE, "mlp_classifier": MLPClassifier, "cnn_classifier": CNNClassifier}

_NOT_OPTIONS = ("self", "input_shape", "num_classes", "ctx")


def model_class(name: str) -> type:
    """The registered class, or `package.module:Class` imported."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise UserError(
                f"config key 'model.name': cannot import module {module_name!r} for {name!r}: {e}"
            ) from None
        cls = getattr(module, attr, None)
        if cls is None:
            raise UserError(f"config key 'model.name': module {module_name!r} has no attribute {attr!r}")
        if not (
            isinstance(cls, type)
            and issubclass(cls, nnx.Module)
            and hasattr(cls, "metrics")
            and hasattr(cls, "loss_metric")
        ):
            raise UserError(f"config key 'model.name': {name!r} is not an nnx.Module with `metrics` and `loss_metric`")
        return cls
    raise UserError(
        f"config key 'model.name': unknown model {name!r}{did_you_mean(name, REGISTRY)}; "
        f"known: {', '.join(REGISTRY)}, or 'package.module:Class'"
    )


def resolve_options(cfg: ModelConfig) -> dict[str, Any]:
    """The constructor keywords: `cfg.options` checked against the signature, defaults filled in."""
    cls = model_class(cfg.name)
    params = {
        n: p
        for n, p in _pyinspect.signature(cls.__init__).parameters.items()
        if n not in _NOT_OPTIONS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    for key in cfg.options:
        if key not in params:
            known = [*params, "name", "input_shape", "num_classes"]
            raise UserError(
                f"unknown config key 'model.{key}' for model {cfg.name!r}{did_you_mean(key, known, 'model.')}; "
                f"options: {', '.join(params) or 'none'} "
                f"(to switch models on the command line, replace the whole section: model={{name: {cfg.name}}})"
            )
    hints = _type_hints(cls.__init__)
    out = {}
    for name, p in params.items():
        if name in cfg.options:
            out[name] = check_type(cfg.options[name], hints.get(name, Any), f"model.{name}")
        elif p.default is p.empty:
            raise UserError(f"config key 'model.{name}' is required by model {cfg.name!r}")
        else:
            out[name] = list(p.default) if isinstance(p.default, tuple) else p.default
    return out


def model_factory(cfg: ModelConfig, spec: DataSpec) -> Callable[[nnx.Context], nnx.Module]:
    """`ctx -> Module` for the configured model and data (checked before anything is built)."""
    cls = model_class(cfg.name)
    options = resolve_options(cfg)
    input_shape = tuple(cfg.input_shape) if cfg.input_shape is not None else spec.input_shape
    num_classes = cfg.num_classes if cfg.num_classes is not None else spec.num_classes

    def build(ctx: nnx.Context) -> nnx.Module:
        try:
            return cls(input_shape, num_classes, **options, ctx=ctx)
        except UserError:
            raise
        except Exception as e:  # the constructor's own checks, or what a bad option breaks inside it
            raise UserError(f"config section 'model': {cfg.name!r} cannot be built from {options}: {e}") from None

    return build


def check_data(cfg: ModelConfig, cls: type, spec: DataSpec, has_labels: bool, label_key: str | None) -> None:
    """The loaded data fits the model: the configured input shape, labels for a classifier."""
    if cfg.input_shape is not None and tuple(cfg.input_shape) != tuple(spec.input_shape):
        raise UserError(
            f"config key 'model.input_shape' {list(cfg.input_shape)} does not match the data's inputs "
            f"{list(spec.input_shape)}; set it to null to take the data's"
        )
    if getattr(cls, "needs_labels", False) and not has_labels:
        raise UserError(
            f"model {cfg.name!r} needs labels, but the dataset has no column {label_key!r}; set data.label_key to "
            "its label column"
        )


def _type_hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # annotations that do not resolve: options go unchecked, as plain Python would
        return {}
