"""`nnx-inspect TARGET [KEY=VALUE ...]`: the model's State without training it.

TARGET is a config YAML (or a shipped config's name: `nnx-configs ls`), a
work dir / checkpoint (its saved config is used), or a Hugging Face model
directory or Hub id (its config.json; no tensor is read). The model is built
abstractly with `jax.eval_shape`, so no parameter memory is allocated and no
dataset is read: input shapes come from `model.input_shape` or a well-known
`data.source` (MNIST, digits). For each entry: path, Variable type, shape,
dtype (and a 4-bit kernel's storage: `uint8 (nf4, block 64)`), element count,
bytes, logical sharding and the mesh PartitionSpec the `sharding.rules` map it to; then
totals per Variable type (`total_params` leaves out a language model's padded
vocabulary rows, so it equals the count `transformers` gives; a mixture of
experts adds `active_params`, those a token computes with; a 4-bit base,
`model.quantize`, adds `base`: its weights and bytes as stored, and in float32
and bfloat16), and for a language model which attention runs on this platform
(`model.attention`). `--json` prints::

    {"total_params": N, "vocab_padding": N, "total_size": N, "total_bytes": N, "attention": "core (auto on cpu)",
     "by_type": {"Param": {"entries": n, "size": n, "bytes": n}, ...},
     "base": {"weights", "bytes", "weights_4bit", "bytes_4bit", "float32_bytes", "bfloat16_bytes"},
     "entries": [{"path", "type", "shape", "dtype", "size", "bytes", "sharding", "mesh_axes", "storage"}, ...]}
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from nnx_cli.errors import UserError, did_you_mean, report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def inspect_state(
    target: Path = typer.Argument(
        ...,
        metavar="TARGET",
        help="Config YAML or shipped config's name, a work dir / checkpoint dir, or a Hugging Face model dir / Hub id.",
        show_default=False,
    ),
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Config overrides, e.g. sharding.mesh.model=2.", show_default=False
    ),
    filter_type: str | None = typer.Option(None, "--filter", help="Keep one Variable type, e.g. Param or BatchStat."),
    depth: int | None = typer.Option(None, min=1, help="Group paths to this many levels."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Show a model's parameters and state, built abstractly from a config or a run."""
    import nnx
    from nnx_cli import hf, steps
    from nnx_cli.commands import configs
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup
    from nnx_cli.report import stderr_console

    if depth is not None and as_json:  # it was ignored without a word
        stderr_console().print("notice: --depth groups the table's rows; --json lists every entry", highlight=False)
    if hf.is_model_dir(target):  # a Hugging Face model directory or Hub id: config.json and headers, no tensor
        exp = setup(hf.model_dir_config(target, overrides or []), data=None, place=False)
        title = str(exp.pretrained.directory)
    elif target.is_dir() or _missing_run(target):
        from nnx_cli import restore
        from nnx_cli.workdir import open_run

        run = open_run(target, overrides or [])
        exp = setup(run.cfg, data=None, place=False)
        say = stderr_console().print
        step, _ = restore.from_run(run, lambda ckpt, s: ckpt.check_matches(s, steps.trainable(exp.abstract)), say)
        title = f"{run.checkpoints / str(step)}"
    else:
        title = str(target)
        config = configs.find(target)  # a path that exists, else a shipped config's name
        exp = setup(load_config(config, overrides or []), data=None, place=False)  # the whole config is checked
    cfg = exp.cfg
    from nnx_cli import sharding

    rows = None if hasattr(exp.objective, "inputs") else cfg.train.batch_size  # GRPO: its completions, checked there
    problem = sharding.preview_problem(exp.abstract, cfg.sharding, exp.rules, rows)
    if problem:  # the table still shows the split asked for; the mesh may be another machine's
        stderr_console().print(f"warning: {problem}", highlight=False)
    entries = state_entries(nnx.State.merge(*steps.model_states(exp.abstract)), exp.rules, _storage(exp))
    if filter_type is not None:
        types = sorted({e["type"] for e in entries})
        if filter_type not in types:
            raise UserError(
                f"--filter {filter_type!r}: the model has no {filter_type!r} "
                f"entries{did_you_mean(filter_type, types)}; types: {', '.join(types)}"
            )
        entries = [e for e in entries if e["type"] == filter_type]
    summary = summarize(entries, _padding(exp) if filter_type in (None, "Param") else 0)
    if any(e["type"] == "QuantizedParam" for e in entries):
        summary["base"] = base_bytes(entries)
    idle = _idle(exp)
    if idle and filter_type in (None, "Param"):
        summary["active_params"] = summary["total_params"] - idle
    attention = exp.attention()
    if attention is not None:
        summary["attention"] = attention
    if as_json:
        print(json.dumps({**summary, "entries": entries}))
    else:
        _print_tables(title, cfg.model.name, entries, summary, depth)


def state_entries(abstract: Any, rules: list[tuple[str, Any]], storage: dict[str, str] | None = None) -> list[dict]:
    """One record per entry of an abstract `State`: type, shape, dtype, size, bytes, logical and mesh axes, and
    how the weight it belongs to is stored (`storage`: a 4-bit kernel's path -> "nf4, block 64"; else its dtype)."""
    import nnx

    entries = []
    storage = storage or {}
    for path, variable in abstract.items():
        value = getattr(variable, "value", variable)
        logical = getattr(variable, "sharding", None)
        mesh_axes = nnx.logical_to_mesh(nnx.get_partition_spec(variable), rules) if logical else None
        size = math.prod(value.shape)
        entries.append(
            {
                "path": path,
                "type": type(variable).__name__,
                "shape": list(value.shape),
                "dtype": str(value.dtype),
                "size": size,
                "bytes": size * value.dtype.itemsize,
                "sharding": list(logical) if logical else None,
                "mesh_axes": [_axis(a) for a in mesh_axes] if mesh_axes is not None else None,
                "storage": storage.get(path.rpartition("/")[0], str(value.dtype)),
            }
        )
    return entries


def _storage(exp: Any) -> dict[str, str]:
    """`{path: "nf4, block 64, double-quantised"}` of the model's 4-bit kernels (`model.quantize`)."""
    import nnx
    from nnx_cli import steps

    model = exp.moduledef.merge(*steps.model_states(exp.abstract))
    return {
        path: f"{m.type}, block {m.block}" + (", double-quantised" if m.double_quant else "")
        for path, m in model.modules()
        if isinstance(m, nnx.QuantizedKernel)
    }


def base_bytes(entries: list[dict[str, Any]]) -> dict[str, int]:
    """The frozen base's weights (every parameter but adapters) and their bytes as stored: those in 4 bits (with
    their scales) and the others; and the bytes all of them take in float32 and in bfloat16."""
    quantized = [e for e in entries if e["type"] == "QuantizedParam"]
    others = [e for e in entries if e["type"] == "Param"]
    weights_4bit = sum(2 * e["size"] for e in quantized if e["path"].endswith("/codes"))
    weights = weights_4bit + sum(e["size"] for e in others)
    return {
        "weights": weights,
        "bytes": sum(e["bytes"] for e in quantized + others),
        "weights_4bit": weights_4bit,
        "bytes_4bit": sum(e["bytes"] for e in quantized),
        "float32_bytes": 4 * weights,
        "bfloat16_bytes": 2 * weights,
    }


def summarize(entries: list[dict[str, Any]], padding: int = 0) -> dict[str, Any]:
    """Totals per Variable type. `total_params` counts the model's parameters without the `padding` elements
    (a language model's padded vocabulary rows, zeros that are never used): the count `transformers` gives for
    the same model."""
    by_type: dict[str, dict[str, int]] = {}
    for e in entries:
        totals = by_type.setdefault(e["type"], {"entries": 0, "size": 0, "bytes": 0})
        totals["entries"] += 1
        totals["size"] += e["size"]
        totals["bytes"] += e["bytes"]
    weights_4bit = sum(2 * e["size"] for e in entries if e["type"] == "QuantizedParam" and e["path"].endswith("/codes"))
    return {
        "total_params": by_type.get("Param", {}).get("size", 0) + weights_4bit - padding,
        "vocab_padding": padding,
        "total_size": sum(e["size"] for e in entries),
        "total_bytes": sum(e["bytes"] for e in entries),
        "by_type": by_type,
    }


def _padding(exp: Any) -> int:
    """Parameters that only pad the vocabulary (see `TransformerLM.padding_params`); 0 for other models."""
    from nnx_cli import steps

    model = exp.moduledef.merge(*steps.model_states(exp.abstract))
    return model.padding_params() if hasattr(model, "padding_params") else 0


def _idle(exp: Any) -> int:
    """Parameters (not adapters) a token does not compute with (a mixture of experts' unrouted experts); 0 for
    other models."""
    from nnx_cli import steps

    model = exp.moduledef.merge(*steps.model_states(exp.abstract))
    return model.idle_params(adapters=False) if hasattr(model, "idle_params") else 0


def _axis(axis: Any) -> Any:
    return list(axis) if isinstance(axis, tuple) else axis


_COLUMNS = [("path", "left"), ("type", "left"), ("shape", "left"), ("dtype", "left"), ("size", "right"),
            ("bytes", "right"), ("sharding", "left"), ("mesh", "left")]  # fmt: skip


def _print_tables(
    title: str, model: str, entries: list[dict[str, Any]], summary: dict[str, Any], depth: int | None
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(markup=False) if Console().is_terminal else Console(width=200, markup=False)
    table = Table(title=f"{title}: model {model!r}", title_justify="left")
    for column, justify in _COLUMNS:
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in _rows(entries, depth):
        table.add_row(*row)
    console.print(table)
    totals = Table(title="totals", title_justify="left")
    for column in ("type", "entries", "size", "bytes"):
        totals.add_column(column, justify="left" if column == "type" else "right")
    for name, t in summary["by_type"].items():
        totals.add_row(name, str(t["entries"]), f"{t['size']:,}", _bytes(t["bytes"]))
    totals.add_row("all", str(len(entries)), f"{summary['total_size']:,}", _bytes(summary["total_bytes"]))
    console.print(totals)
    if summary["vocab_padding"]:
        adapters = summary["by_type"].get("LoRAParam", {}).get("size", 0)
        console.print(
            f"{summary['total_params']:,} parameters{f' and {adapters:,} in adapters' if adapters else ''}, not "
            f"counting {summary['vocab_padding']:,} that pad the vocabulary to a multiple of 128",
            highlight=False,
        )
    if "base" in summary:
        base = summary["base"]
        console.print(
            f"base weights: {base['weights']:,} in {_bytes(base['bytes'])} as stored ({base['weights_4bit']:,} in "
            f"4-bit in {_bytes(base['bytes_4bit'])} with their scales); {_bytes(base['float32_bytes'])} in float32, "
            f"{_bytes(base['bfloat16_bytes'])} in bfloat16",
            highlight=False,
        )
    if "attention" in summary:
        console.print(f"attention: {summary['attention']}", highlight=False)
    if "active_params" in summary:
        console.print(f"{summary['active_params']:,} parameters active per token (the experts it is routed to)",
                      highlight=False)  # fmt: skip


def _rows(entries: list[dict[str, Any]], depth: int | None) -> list[tuple[str, ...]]:
    """Table rows: a header row with totals for each subtree (down to `depth` levels), then the entries."""
    rows, shown = [], set()
    for e in entries:
        parts = e["path"].split("/")
        levels = len(parts) if depth is None else min(len(parts), depth)
        for level in range(1, levels + (0 if levels == len(parts) else 1)):
            group = "/".join(parts[:level])
            if group in shown:
                continue
            shown.add(group)
            members = [m for m in entries if m["path"].startswith(group + "/")]
            types = ", ".join(sorted({m["type"] for m in members}))
            size, nbytes = sum(m["size"] for m in members), sum(m["bytes"] for m in members)
            rows.append(
                ("  " * (level - 1) + parts[level - 1] + "/", types, "", "", f"{size:,}", _bytes(nbytes), "", "")
            )
        if levels < len(parts):
            continue
        sharding = "(" + ", ".join(str(a) for a in e["sharding"]) + ")" if e["sharding"] else "-"
        axes = e["mesh_axes"] or []
        mesh = "P(" + ", ".join(repr(tuple(a) if isinstance(a, list) else a) for a in axes) + ")"
        indent = "  " * (len(parts) - 1)
        shape = str(tuple(e["shape"]))
        dtype = e["dtype"] if e.get("storage", e["dtype"]) == e["dtype"] else f"{e['dtype']} ({e['storage']})"
        rows.append((indent + parts[-1], e["type"], shape, dtype, f"{e['size']:,}", _bytes(e["bytes"]), sharding, mesh))
    return rows


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _missing_run(target: Path) -> bool:
    """A path that does not exist, under a directory (`runs/tiny_ml`), and not a config file's name: meant as a
    work dir, which `open_run` says does not exist (with the closest name beside it)."""
    return not target.exists() and target.suffix not in (".yaml", ".yml") and target.parent != Path(".")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
