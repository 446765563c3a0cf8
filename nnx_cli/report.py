"""What a run shows: metric tables, metric formatting, PNG grids, the progress of long set-up work.

- `metrics_table` renders an eval; `format_metrics` one line of metrics;
  `json_metrics` makes them strict JSON; `write_image_grid` tiles images;
  `progress` shows how far decoding or tokenizing has got.
- Where metrics go during training (metrics.jsonl, the progress bar,
  TensorBoard, W&B) is `nnx_cli.loggers`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table


def stderr_console(quiet: bool = False) -> Console:
    """Where progress and messages go; `quiet` for every process but the first. Messages are plain text: a path
    or prompt holding `[...]` is printed as it is, not read as Rich markup, and a long one is not folded."""
    return Console(stderr=True, quiet=quiet, markup=False, soft_wrap=True)  # one message, one line (grep, logs)


def json_metrics(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """Metrics as strict JSON numbers: a NaN or infinity becomes null."""
    return {k: float(v) if math.isfinite(v) else None for k, v in metrics.items()}


def format_metrics(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def metrics_table(title: str, metrics: Mapping[str, float]) -> Table:
    table = Table(title=title, title_justify="left", min_width=len(title))  # as wide as its title: no wrapped title
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in metrics.items():
        table.add_row(name, f"{value:.6g}")
    return table


def write_image_grid(images: np.ndarray, path: str | Path, columns: int = 8, scale: int = 4) -> None:
    """Tile `[N, H, W, C]` images in [0, 1] into one PNG, `columns` per row, upscaled by `scale`."""
    from PIL import Image

    images = np.clip(np.asarray(images, np.float32), 0.0, 1.0)
    if images.ndim == 3:
        images = images[..., None]
    n, h, w, c = images.shape
    rows = -(-n // columns)
    grid = np.ones((rows * (h + 1) + 1, columns * (w + 1) + 1, c), np.float32)
    for i, img in enumerate(images):
        r, col = divmod(i, columns)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + col * (w + 1) : 1 + col * (w + 1) + w] = img
    pixels = (grid * 255).round().astype(np.uint8)
    pixels = pixels.repeat(scale, 0).repeat(scale, 1)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(c)
    if mode is None:
        pixels, mode = pixels[..., :1], "L"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode=mode).save(path)


# Off a terminal (a log file, CI, nohup) a long piece of set-up work says how far it has got: first after this
# many seconds, then as often; shorter work says nothing.
PROGRESS_EVERY_S = 30.0


@contextlib.contextmanager
def progress(
    total: int, description: str, *, at_least: int = 0, in_bytes: bool = False
) -> Iterator[Callable[[int], None]]:
    """Yields `advance(n)` for work of `total` units (bytes with `in_bytes`), shown on stderr: a rich progress
    bar on a terminal (gone when done), else a plain line every :data:`PROGRESS_EVERY_S` seconds. Work of fewer
    than `at_least` units shows nothing."""
    if total < at_least:
        yield lambda n: None
        return
    if sys.stderr.isatty():
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        amount = DownloadColumn() if in_bytes else MofNCompleteColumn()
        columns = (TextColumn("{task.description}", markup=False), BarColumn(), amount, TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True, markup=False), transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
        return
    start = time.monotonic()
    state = {"done": 0, "said": start}
    amount = (lambda n: f"{n / 1e9:,.2f} GB") if in_bytes else (lambda n: f"{n:,}")

    def advance(n: int) -> None:
        state["done"] += n
        now = time.monotonic()
        if now - state["said"] >= PROGRESS_EVERY_S:
            state["said"] = now
            share = f" ({100 * state['done'] / total:.0f}%)" if total else ""
            print(f"{description}: {amount(state['done'])} of {amount(total)}{share}, {now - start:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    yield advance
