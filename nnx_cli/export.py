"""`nnx-export TARGET --out DIR`: a run's weights as a Hugging Face model directory, or a PEFT adapter.

TARGET is a work dir, its `checkpoints/` dir or one step dir of a `transformer_lm` run. The newest usable
step (or `--step N`, or `--best`) is written to `--out` as a directory `transformers` loads
(`AutoModelForCausalLM.from_pretrained(DIR)`): merged weights by default (`--merge`: LoRA adapters added into
the weights they adapt), or with `--adapter` the LoRA adapters alone, as `peft` saves them
(`PeftModel.from_pretrained(base, DIR)`). `--dtype` is float32, bfloat16 or float16 (default: the base
model's dtype, float32 for a run trained from scratch, bfloat16 for a 4-bit base, written dequantised), or nf4
or fp4: the projections quantised to 4 bits as `transformers` saves a bitsandbytes model (the rest in bfloat16).
The export is written beside `--out` and renamed into place; an existing `--out` that is not empty is refused.
"""

from __future__ import annotations

from pathlib import Path

import typer

from nnx_cli.errors import UserError, report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def export(
    target: Path = typer.Argument(
        ..., metavar="TARGET", help="Work dir, its checkpoints/ dir, or one step dir.", show_default=False
    ),
    out: Path = typer.Option(..., "--out", help="The directory to write (new, or empty).", show_default=False),
    step: int | None = typer.Option(None, help="Checkpoint step (default: the newest usable one)."),
    best: bool = typer.Option(False, "--best", help="The best step kept by checkpoint.keep_best."),
    merge: bool = typer.Option(False, "--merge", help="Merged weights (the default)."),
    adapter: bool = typer.Option(False, "--adapter", help="The LoRA adapters alone, as a PEFT adapter."),
    dtype: str | None = typer.Option(
        None, help="float32, bfloat16 or float16 (default: the base model's); nf4 or fp4: bitsandbytes 4-bit."
    ),
) -> None:
    """Write a run's weights as a Hugging Face model directory (or a PEFT adapter)."""
    import jax
    import numpy as np

    from nnx_cli import runtime
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.generate import language_model, restore_parameters
    from nnx_cli.hf import export as exporting
    from nnx_cli.report import stderr_console
    from nnx_cli.workdir import open_run

    if merge and adapter:
        raise UserError("--merge and --adapter choose one form of the export: pass one of them")
    exporting.check_out(out)  # before anything is read
    runtime.configure()
    run = open_run(target, [], step, best=best)
    exp = language_model(run, "nnx-export writes")
    exporting.check(exp, out, adapter=adapter, dtype=dtype)
    tokenizer = load_tokenizer(run.cfg.data.tokenizer, run.cfg.model.pretrained)
    step, params = restore_parameters(run, exp, jax.devices("cpu")[0])
    arrays = {path: np.asarray(variable.value) for path, variable in params.items()}  # views of the host buffers
    del params
    files = exporting.export(exp, arrays, out, adapter=adapter, dtype=dtype, tokenizer=tokenizer)
    stderr_console().print(
        f"wrote {out} ({exporting.describe(out)}, {exporting.total_size(out)}) from {run.checkpoints / str(step)}: "
        f"{exporting.listing(files)}",
        highlight=False,
        soft_wrap=True,
    )


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
