"""What a run tells the world: metrics.jsonl, progress, metric tables, PNG grids.

- `MetricsLog` appends `{"step", "split", "metrics", "time"}` lines to
  `<workdir>/metrics.jsonl`; on resume it drops lines past the restored step,
  so the file always describes the run that the checkpoints hold.
- `Progress` is a rich progress bar (step, loss, steps/s, ETA) on a terminal
  and a plain log line every `log_every` steps otherwise.
- `metrics_table` and `write_image_grid` render evals.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table


def stderr_console(quiet: bool = False) -> Console:
    """Where progress and messages go; `quiet` for every process but the first."""
    return Console(stderr=True, quiet=quiet)


class MetricsLog:
    """`metrics.jsonl`: one JSON object per train log or eval.

    On resume from step `resume_step` the file is cut back to what an
    uninterrupted run would have written by then: records past that step go,
    and so do the end-of-run records at that step that fall off their
    interval (`intervals`: split -> steps between records), such as the last
    train log of a run stopped between two logs.
    """

    def __init__(self, path: str | Path, resume_step: int, intervals: Mapping[str, int] | None = None):
        self.path = Path(path)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _kept(line, resume_step, intervals or {})]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "split": split, "metrics": json_metrics(metrics), "time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _kept(line: str, resume_step: int, intervals: Mapping[str, int]) -> bool:
    try:
        record = json.loads(line)
        step, split = record["step"], record["split"]
    except (ValueError, KeyError, TypeError):
        return False  # a torn last line from a killed run
    if step < resume_step:
        return True
    return step == resume_step and step % intervals.get(split, 1) == 0


def json_metrics(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """Metrics as strict JSON numbers: a NaN or infinity becomes null."""
    return {k: float(v) if math.isfinite(v) else None for k, v in metrics.items()}


def format_metrics(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def metrics_table(title: str, metrics: Mapping[str, float]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in metrics.items():
        table.add_row(name, f"{value:.6g}")
    return table


class Progress:
    """Training progress: a live bar on a terminal, periodic plain lines otherwise."""

    def __init__(self, console: Console, start: int, total: int, loss_name: str):
        self.console = console
        self.total = total
        self.loss_name = loss_name
        self.live = console.is_terminal
        self._last_step, self._last_time = start, time.perf_counter()
        self._bar: RichProgress | None = None
        self._last_tick = 0.0
        if self.live:
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, loss="", rate="")
            self._bar.start()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Called every `log_every` steps with the mean train metrics since the last call."""
        now = time.perf_counter()
        rate = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=step,
                loss=f"{self.loss_name} {metrics.get(self.loss_name, float('nan')):.4g}",
                rate=f"{rate:.1f} steps/s",
            )
        else:
            self.console.print(
                f"step {step}/{self.total} {format_metrics(metrics)} ({rate:.1f} steps/s)",
                highlight=False,
                soft_wrap=True,
            )

    def tick(self, step: int) -> None:
        """Called every step: moves the live bar (no device sync; at most 10 redraws/s)."""
        if self._bar is not None and time.perf_counter() - self._last_tick > 0.1:
            self._last_tick = time.perf_counter()
            self._bar.update(self._task, completed=step)

    def print(self, renderable: Any) -> None:
        self.console.print(renderable, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


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
