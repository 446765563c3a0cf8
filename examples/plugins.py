"""Your own model, data source, optimizer and metric logger for nnx-train, from one file beside your config.

Copy this file into your project directory and name its pieces in the config or on the command line; nnx-train
imports `plugins` from the current directory (no PYTHONPATH needed):

    nnx-train cfg.yaml model.name=plugins:Wide model.width=128 data.source=plugins:stripes \\
        optimizer.name=plugins:sgd_nesterov optimizer.learning_rate=0.05 "logging.loggers=[jsonl, plugins:Printer]"
"""

import numpy as np
import optax

import nnx
from nnx_cli.models import MLPClassifier


class Wide(MLPClassifier):
    """A model: an nnx.Module with `metrics(batch, ctx)` and `loss_metric` (here inherited)."""

    def __init__(self, input_shape, num_classes=None, *, width: int = 64, ctx: nnx.Context):
        super().__init__(input_shape, num_classes, hidden_sizes=[width, width], ctx=ctx)


def stripes(split: str) -> dict[str, np.ndarray]:
    """A data source: split -> arrays (or a `datasets.Dataset`); a split it does not have is a KeyError."""
    rng = np.random.default_rng({"train": 0, "test": 1}[split])
    labels = rng.integers(0, 2, 1024)
    images = np.stack([np.tile(np.arange(16) % (2 + label), (16, 1)) for label in labels]) * 50
    return {"image": images.astype(np.uint8)[..., None], "label": labels}


def sgd_nesterov(learning_rate, momentum: float = 0.9) -> optax.GradientTransformation:
    """An optimizer: the optimizer section's keywords (learning_rate included) -> an optax transformation."""
    return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


class Printer:
    """A metric logger: `log(step, split, metrics)` and `close()`, built from a `nnx_cli.loggers.LoggerRun`."""

    def __init__(self, run):
        self.run = run

    def log(self, step, split, metrics):
        print(step, split, round(metrics["loss"], 4), flush=True)

    def close(self):
        pass
