"""`nnx-configs ls | cp NAME DEST`: the configs that ship with nnx, to start from.

The configs of a checkout's `configs/` are package data (`nnx_cli/recipes/`,
which `configs/` links to), so an installed nnx has them too. `ls` lists them,
a line each: the first line of the config's opening comment. `cp` copies one
out to edit. `nnx-train NAME` and `nnx-inspect NAME` take one by name from any
directory; a path that exists wins over a name::

    $ nnx-configs ls
    chat_lora         LoRA fine-tune of a small instruct model on your own chats.
    digits_vae        A VAE on the 8x8 digits shipped with scikit-learn: no network, trains in seconds.
    ...
    $ nnx-configs cp chat_lora my_chat.yaml
    $ nnx-train my_chat.yaml data.source=my_chats.jsonl
"""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from nnx_cli.errors import UserError, did_you_mean, report_errors, run_app

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
"""Where the shipped configs live: package data."""

HELP = """The configs that ship with nnx, to start from.

nnx-configs ls lists them, with what each is for; nnx-configs cp NAME DEST copies one out to edit. \
nnx-train NAME and nnx-inspect NAME take one by name from any directory (a path that exists wins over a name).

    nnx-configs ls
    nnx-configs cp chat_lora my_chat.yaml
    nnx-train my_chat.yaml data.source=my_chats.jsonl
"""
"""`--help` and the commands reference: the module's docstring less its reStructuredText (backticks, `::`),
which the terminal shows as typed; a paragraph a line (the terminal wraps it), the commands as a Markdown code
block."""

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=HELP)


def shipped() -> dict[str, Path]:
    """Every shipped config, by name (its file's stem), in the order of their names.

    >>> shipped()["digits_vae"].name
    'digits_vae.yaml'
    """
    return {path.stem: path for path in sorted(RECIPES.glob("*.yaml"))}


def summary(path: Path) -> str:
    """What a config is for: the first line of its opening comment, without the `#`."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.lstrip("#").strip():
            return line.lstrip("#").strip()
    return ""


def find(config: str | Path) -> Path:
    """The config file that `config` names: a path that exists, else a shipped config by its name (`digits_vae`,
    or `digits_vae.yaml`). Anything else is a UserError that lists the shipped configs.

    >>> find("digits_vae") == shipped()["digits_vae"]      # from a directory without a file of that name
    True
    """
    path = Path(config)
    if path.exists():
        return path
    recipes = shipped()
    name = path.name.removesuffix(".yaml")
    if path.parent == Path(".") and name in recipes:
        return recipes[name]
    if path.parent != Path("."):  # meant as a path: say so, and where the same config is when it ships
        ships = f"; {name!r} ships with nnx: pass its name alone ({name})" if name in recipes else ""
        raise UserError(f"config file {str(path)!r} does not exist{ships}")
    raise UserError(
        f"config file {str(path)!r} does not exist, and no config of that name ships with nnx"
        f"{did_you_mean(name, recipes)}; shipped: {', '.join(recipes)} (nnx-configs ls says what each is for)"
    )


def listing() -> list[str]:
    """What `nnx-configs ls` prints: a line per shipped config, its name and then what it is for."""
    recipes = shipped()
    width = max(map(len, recipes)) + 2
    return [f"{name:<{width}}{summary(path)}".rstrip() for name, path in recipes.items()]


def _shipped(name: str) -> Path:
    """The shipped config `name` (with or without `.yaml`); a UserError listing them for any other name."""
    recipes = shipped()
    name = name.removesuffix(".yaml")
    if name not in recipes:
        raise UserError(
            f"no config named {name!r} ships with nnx{did_you_mean(name, recipes)}; shipped: {', '.join(recipes)}"
        )
    return recipes[name]


def copy(name: str, dest: str | Path) -> Path:
    """Copy the shipped config `name` to the file `dest`, or into the directory `dest` (one that exists, or a path
    ending in `/`) as `NAME.yaml`; return the file written. A file that exists is never written over.

    >>> copy("chat_lora", "my_chat.yaml")      # doctest: +SKIP
    PosixPath('my_chat.yaml')
    """
    source, name = _shipped(name), name.removesuffix(".yaml")
    into = Path(dest).is_dir() or str(dest).endswith(("/", "\\"))
    target = Path(dest) / f"{name}.yaml" if into else Path(dest)
    if target.exists():
        raise UserError(f"{str(target)!r} exists already; nnx-configs cp writes a new file: name another DEST")
    blocking = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # mkdir said "File exists", of the directory it could not make
        raise UserError(
            f"cannot write {str(target)!r}: {str(blocking)!r} is a file, not a directory; name another DEST"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    except OSError as e:
        raise UserError(
            f"cannot write {str(target)!r}: {e.strerror or e}; name a DEST in a writable directory"
        ) from None
    return target


@app.command("ls")
@report_errors
def ls() -> None:
    """List the shipped configs, a line each: its name, then what it is for."""
    print("\n".join(listing()))


@app.command("cp")
@report_errors
def cp(
    name: str = typer.Argument(..., metavar="NAME", help="A shipped config (nnx-configs ls).", show_default=False),
    dest: str = typer.Argument(
        ...,
        metavar="DEST",
        help="The file to write, a directory (DIR/) to put NAME.yaml in, or - for standard output.",
        show_default=False,
    ),
) -> None:
    """Copy a shipped config out, to edit and train with: nnx-train DEST (DEST - prints it)."""
    if dest == "-":
        print(_shipped(name).read_text(), end="")
        return
    target = copy(name, dest)
    print(f"copied {name.removesuffix('.yaml')} to {target}; edit it, then: nnx-train {target}")


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
