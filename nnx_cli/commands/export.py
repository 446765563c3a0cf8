"""`nnx-export TARGET --out DIR`: a run's weights as a Hugging Face model directory, or a PEFT adapter.

TARGET is a work dir, its `checkpoints/` dir or one step dir of a `transformer_lm` run. The newest usable
step (or `--step N`, or `--best`) is written to `--out` as a directory `transformers` loads
(`AutoModelForCausalLM.from_pretrained(DIR)`): merged weights by default (`--merge`: LoRA adapters added into
the weights they adapt), or with `--adapter` the LoRA adapters alone, as `peft` saves them
(`PeftModel.from_pretrained(base, DIR)`). `--dtype` is float32, bfloat16 or float16 (default: the base
model's dtype, float32 for a run trained from scratch, bfloat16 for a 4-bit base, written dequantised), or nf4
or fp4: the projections quantised to 4 bits as `transformers` saves a bitsandbytes model (the rest in bfloat16).
The export is written beside `--out` and renamed into place; an existing `--out` that is not empty is refused.

`--format gguf` writes one GGUF file instead, as llama.cpp's converter writes it (llama.cpp, Ollama and LM Studio
run it): TARGET may also be a Hugging Face model directory, LoRA adapters are merged, and `--dtype` is f32, f16,
bf16 or q8_0 (default: bf16 for bfloat16 weights, else f16). `--ollama` adds a `Modelfile` beside it. An existing
`--out` file is refused unless `--overwrite`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from nnx_cli.errors import UserError, report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def export(
    target: Path = typer.Argument(
        ...,
        metavar="TARGET",
        help="Work dir, its checkpoints/ dir, or one step dir; with --format gguf also a Hugging Face model dir "
        "(or Hub id) or a .gguf file (written again in --dtype).",
        show_default=False,
    ),
    out_given: str = typer.Option(
        ...,
        "--out",
        help="The directory to write (new, or empty); with --format gguf, the .gguf file.",
        show_default=False,
    ),
    step: int | None = typer.Option(None, help="Checkpoint step (default: the newest usable one)."),
    best: bool = typer.Option(False, "--best", help="The best step kept by checkpoint.keep_best."),
    merge: bool = typer.Option(
        False,
        "--merge",
        help="Adapters merged into the weights: what is written without --adapter, so the flag only says it.",
    ),
    adapter: bool = typer.Option(False, "--adapter", help="The LoRA adapters alone, as a PEFT adapter."),
    dtype: str | None = typer.Option(
        None,
        help="float32, bfloat16 or float16 (default: the base model's); nf4 or fp4: bitsandbytes 4-bit; "
        "with --format gguf: f32, f16, bf16 or q8_0.",
    ),
    format: str = typer.Option("hf", "--format", help="hf (a Hugging Face model directory) or gguf (one file)."),
    ollama: bool = typer.Option(False, "--ollama", help="With --format gguf: a Modelfile for Ollama beside it."),
    overwrite: bool = typer.Option(False, "--overwrite", help="With --format gguf: replace an existing --out file."),
) -> None:
    """Write a run's weights as a Hugging Face model directory (or a PEFT adapter), or as one GGUF file."""
    import jax

    from nnx_cli import runtime
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.gguf.export import DTYPES as GGUF_DTYPES
    from nnx_cli.hf import export as exporting
    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.report import stderr_console
    from nnx_cli.workdir import open_run

    if merge and adapter:
        raise UserError("--merge and --adapter choose one form of the export: pass one of them")
    if format not in ("hf", "gguf"):
        raise UserError(f"--format {format!r}: expected hf (a Hugging Face model directory) or gguf (one file)")
    out = Path(out_given)
    if format == "gguf":
        if out_given.endswith(("/", os.sep)):  # Path() drops the slash: the file would take the directory's name
            raise UserError(f"--out {out_given!r} names a directory; give the path of the .gguf file to write "
                            f"(e.g. {out_given}model.gguf)")  # fmt: skip
        return _gguf(target, out, step=step, best=best, adapter=adapter, dtype=dtype, ollama=ollama,
                     overwrite=overwrite)  # fmt: skip
    if ollama or overwrite:
        flag = "--ollama" if ollama else "--overwrite"
        raise UserError(
            f"{flag} goes with --format gguf: add it, or drop {flag} (a Hugging Face export never overwrites: give a "
            "new --out)"
        )
    if dtype in GGUF_DTYPES and dtype not in (*exporting.DTYPES, *exporting.FOUR_BIT):
        raise UserError(
            f"--dtype {dtype!r} is a GGUF type: add --format gguf to write a GGUF file, or give one of "
            f"{', '.join((*exporting.DTYPES, *exporting.FOUR_BIT))} for a Hugging Face directory"
        )
    from nnx_cli import hf

    if hf.is_model_dir(target):  # it said there was no checkpoint in it, and to train first
        what = "a GGUF file" if target.suffix == ".gguf" else "a Hugging Face model (a model dir or Hub id)"
        raise UserError(
            f"{str(target)!r} is {what}, not a run: nnx-export writes a run's checkpoint as a Hugging Face model "
            "dir, and a model dir as a GGUF file with --format gguf"
        )
    exporting.check_out(out)  # before anything is read
    runtime.configure()
    run = open_run(target, [], step, best=best)
    _outside_checkpoints(out, run)
    exp = language_model(run, "nnx-export writes")
    exporting.check(exp, out, adapter=adapter, dtype=dtype)
    tokenizer = load_tokenizer(run.cfg.data.tokenizer, run.cfg.model.pretrained)
    step, params = restore_parameters(run, exp, jax.devices("cpu")[0], export=True)
    arrays = _host(params)
    del params
    files = exporting.export(exp, arrays, out, adapter=adapter, dtype=dtype, tokenizer=tokenizer)
    stderr_console().print(
        f"wrote {out} ({exporting.describe(out)}, {exporting.total_size(out)}) from {run.checkpoints / str(step)}: "
        f"{exporting.listing(files)}",
        highlight=False,
        soft_wrap=True,
    )


def _outside_checkpoints(out: Path, run: Any) -> None:
    """`--out` inside the run's checkpoints would add a file to a sealed step: it would fail verification."""
    if out.resolve().is_relative_to(run.checkpoints.resolve()):
        raise UserError(
            f"--out {str(out)!r} is inside the run's checkpoints ({run.checkpoints}), where a file the checksums do "
            "not list makes its step unusable; give a path outside them (nothing was written)"
        )


def _gguf(target: Path, out: Path, *, step: int | None, best: bool, adapter: bool, dtype: str | None, ollama: bool,
          overwrite: bool) -> None:  # fmt: skip
    """`--format gguf`: a run's (adapters merged) or a model directory's weights as one GGUF file."""
    import tempfile

    from nnx_cli import hf, runtime
    from nnx_cli.gguf import export as gguf_export
    from nnx_cli.gguf import ollama as modelfile
    from nnx_cli.gguf import require
    from nnx_cli.report import stderr_console

    require()
    if adapter:
        raise UserError("--adapter with --format gguf: a GGUF file holds merged weights; drop --adapter")
    dtype = gguf_export.SAME_TYPES.get(dtype, dtype)  # --dtype bfloat16 --format gguf: bf16, not a refusal
    gguf_export.check_dtype(dtype)
    gguf_export.check_out(out, overwrite)
    if ollama:
        modelfile.check_out(out, overwrite)
    if hf.is_model_dir(target):
        hf.check_no_step(target, step, best)
        source = gguf_export.from_model_dir(target)
        written = gguf_export.write(source, out, dtype, overwrite=overwrite)
        origin = str(source.files)
    else:
        import jax

        from nnx_cli.data.tokenizers import load_tokenizer
        from nnx_cli.lm import language_model, restore_parameters
        from nnx_cli.workdir import open_run

        runtime.configure()
        run = open_run(target, [], step, best=best)
        _outside_checkpoints(out, run)
        exp = language_model(run, "nnx-export writes")
        tokenizer = load_tokenizer(run.cfg.data.tokenizer, run.cfg.model.pretrained)
        step, params = restore_parameters(run, exp, jax.devices("cpu")[0], export=True)
        arrays = _host(params)
        del params
        with tempfile.TemporaryDirectory(prefix="nnx-gguf-") as files:
            source = gguf_export.from_run(exp, arrays, tokenizer, Path(files), name=run.workdir.name)
            del arrays  # the source's are the only references left: each parameter is freed once written
            written = gguf_export.write(source, out, dtype, overwrite=overwrite)
        origin = str(run.checkpoints / str(step))
    if ollama:
        modelfile.write(out)
    for note in written["notes"]:
        stderr_console().print(f"note: {note}", highlight=False, soft_wrap=True)
    extra = f" and {modelfile.NAME}" if ollama else ""
    stderr_console().print(
        f"wrote {out}{extra} ({written['architecture']}, {written['dtype']}, {written['tensors']} tensors, "
        f"{gguf_export.human_size(written['bytes'])}) from {origin}",
        highlight=False,
        soft_wrap=True,
    )


def _host(params: Any) -> dict[str, Any]:
    """Path -> each parameter as a host array (a view of its buffer), or the reader a base parameter is
    (:meth:`.hf.Pretrained.lazy`), left to read itself as it is written."""
    import numpy as np

    from nnx_cli.hf.weights import Lazy

    return {path: v.value if isinstance(v.value, Lazy) else np.asarray(v.value) for path, v in params.items()}


def main() -> None:
    run_app(app, makes_files=True)


if __name__ == "__main__":
    main()
