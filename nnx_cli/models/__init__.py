"""Models a run can train: the `TrainableModel` protocol and the `model.name` registry.

A trainable model is an `nnx.Module` built as
`Model(input_shape, num_classes, *, <options>, ctx)`: `input_shape` is one
example's shape (`[28, 28, 1]`, or `[seq_len]` for text), `num_classes` the
label count (the vocabulary size for text) or None, `<options>` the other
keys of the config's `model` section and `ctx` the `params` RNG stream. It
follows :class:`TrainableModel`.

Shipped (each in its own module): `vae`, `mlp_classifier`,
`cnn_classifier`. Your own is `model.name: package.module:Class`, imported
from the current directory::

    # my_models.py, beside the config
    class Wide(nnx_cli.models.MLPClassifier):
        def __init__(self, input_shape, num_classes=None, *, width: int = 8, ctx):
            super().__init__(input_shape, num_classes, hidden_sizes=[width, width], ctx=ctx)

    # nnx-train cfg.yaml model.name=my_models:Wide model.width=64

Options are checked against the constructor's signature and annotations
before anything is built. Every parameter should declare logical axes
(`nnx.with_logical_partitioning`) so that `sharding.rules` can place it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

import nnx
from nnx_cli.config import ModelConfig
from nnx_cli.errors import UserError
from nnx_cli.models.classifiers import CNNClassifier, MLPClassifier
from nnx_cli.models.transformer import TransformerLM
from nnx_cli.models.vae import VAE
from nnx_cli.registry import Registry, bind_options

__all__ = [
    "MODELS",
    "REGISTRY",
    "VAE",
    "CNNClassifier",
    "MLPClassifier",
    "TrainableModel",
    "TransformerLM",
    "check_data",
    "model_class",
    "model_factory",
    "option_defaults",
    "resolve_options",
]


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer needs from a model.

    - `loss_metric`: the name of the metric training minimises (its batch mean).
    - `metrics(batch, ctx)`: `{name: per-example array}`; `batch` holds the
      data's columns (`image`, `label`, or `tokens` for text) and, in eval,
      `mask`. Evaluation averages every entry over the eval split.
    - optionally `images(batch, ctx) -> [N, H, W, C]` in `[0, 1]`: a PNG grid
      written at each eval.

    `ctx` carries the `sample` and `dropout` RNG streams and the
    `deterministic` and `use_running_average` flags (False while training,
    True in eval).
    """

    loss_metric: ClassVar[str]

    def metrics(self, batch: dict[str, jax.Array], ctx: nnx.Context) -> dict[str, jax.Array]: ...


def _check_model(obj: Any, name: str) -> None:
    if not (isinstance(obj, type) and issubclass(obj, nnx.Module) and hasattr(obj, "metrics")):
        raise UserError(
            f"config key 'model.name': {name!r} is not an nnx.Module class with `metrics` and `loss_metric`"
        )
    if not isinstance(getattr(obj, "loss_metric", None), str):
        raise UserError(f"config key 'model.name': {name!r} has no `loss_metric` naming the metric to minimise")


MODELS: Registry[type] = Registry("model", "model.name", check=_check_model)
MODELS.register("vae", VAE)
MODELS.register("mlp_classifier", MLPClassifier)
MODELS.register("cnn_classifier", CNNClassifier)
MODELS.register("transformer_lm", TransformerLM)
REGISTRY = MODELS  # the name earlier releases exported

_NOT_OPTIONS = ("input_shape", "num_classes", "ctx")


def model_class(name: str) -> type:
    """The registered class, or `package.module:Class` imported."""
    return MODELS.get(name)


def resolve_options(cfg: ModelConfig) -> dict[str, Any]:
    """The constructor keywords: `cfg.options` checked against the signature, defaults filled in."""
    return bind_options(
        model_class(cfg.name),
        cfg.options,
        prefix="model.",
        what=f"model {cfg.name!r}",
        skip=_NOT_OPTIONS,
        fixed=("name", "input_shape", "num_classes"),
        fill_defaults=True,
        check_types=True,
        hint=f" (to switch models on the command line, replace the whole section: model={{name: {cfg.name}}})",
    )


def option_defaults(cls: type) -> dict[str, Any]:
    """The default of every constructor option of model class `cls`."""
    import inspect

    from nnx_cli.registry import signature

    return {
        name: p.default
        for name, p in signature(cls).parameters.items()
        if name not in _NOT_OPTIONS and p.default is not inspect.Parameter.empty
    }


def model_factory(cfg: ModelConfig, spec: Any) -> Callable[[nnx.Context], nnx.Module]:
    """`ctx -> Module` for the configured model and data spec (options checked before anything is built)."""
    cls = model_class(cfg.name)
    options = resolve_options(cfg)
    input_shape = tuple(cfg.input_shape) if cfg.input_shape is not None else spec.input_shape
    num_classes = cfg.num_classes if cfg.num_classes is not None else spec.num_classes
    given = {k: v for k, v in options.items() if k in cfg.options}  # the options the config set (not defaults)

    def build(ctx: nnx.Context) -> nnx.Module:
        try:
            return cls(input_shape, num_classes, **options, ctx=ctx)
        except UserError:
            raise
        except ValueError as e:
            key = re.match(r"model\.[\w.]+", str(e))
            if key:  # the constructor's own checks name the option: that says it all, quoted as every key is
                raise UserError(f"config key {key[0]!r}{str(e)[key.end() :]}") from None
            if re.search(r"\b(model|data|train)\.[a-z_]+", str(e)):  # it names the keys at fault
                raise UserError(f"config section 'model': {cfg.name!r} cannot be built: {e}") from None
            raise UserError(f"config section 'model': {cfg.name!r} cannot be built from {given}: {e}") from None
        except Exception as e:  # what a bad option breaks inside the constructor
            raise UserError(f"config section 'model': {cfg.name!r} cannot be built from {given}: {e}") from None

    return build


def check_data(cfg: ModelConfig, cls: type, spec: Any, has_labels: bool, label_key: str | None) -> None:
    """The loaded data fits the model: the configured input shape, labels for a classifier."""
    if cfg.input_shape is not None and tuple(cfg.input_shape) != tuple(spec.input_shape):
        raise UserError(
            f"config key 'model.input_shape' {list(cfg.input_shape)} does not match the data's inputs "
            f"{list(spec.input_shape)}; set it to null to take the data's"
        )
    if getattr(cls, "needs_labels", False) and not has_labels and label_key is None:
        raise UserError(
            f"config key 'data.label_key' is null, and model {cfg.name!r} needs labels; set it to the dataset's "
            "label column"
        )
    if getattr(cls, "needs_labels", False) and not has_labels:
        raise UserError(
            f"model {cfg.name!r} needs labels, but the dataset has no column {label_key!r}; set data.label_key to "
            "its label column"
        )
