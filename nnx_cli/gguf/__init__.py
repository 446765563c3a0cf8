"""GGUF: the one-file format llama.cpp, Ollama and LM Studio run, written and read as llama.cpp's converter does.

`nnx-export TARGET --format gguf --out FILE.gguf` writes a run, a checkpoint step or a Hugging Face model
directory as one GGUF file (:mod:`nnx_cli.gguf.export`): the family's tensors under llama.cpp's names and layouts
(:mod:`nnx_cli.gguf.families`), its hyper-parameters, and its tokenizer and chat template
(:mod:`nnx_cli.gguf.vocab`), in float32, float16, bfloat16 or llama.cpp's 8-bit `q8_0`. With `--ollama`, a
`Modelfile` beside it (:mod:`nnx_cli.gguf.ollama`). A `.gguf` file is also a TARGET of `nnx-generate`, `nnx-eval`
and `nnx-inspect`, and a `model.pretrained` (:mod:`nnx_cli.gguf.read`).

The files are written and read with llama.cpp's own `gguf` package, an optional dependency
(`pip install gguf`, or the `gguf` extra).
"""

from __future__ import annotations

from typing import Any

from nnx_cli.errors import UserError

INSTALL = "pip install 'gguf>=0.19' (the gguf extra of nnx)"


def require() -> Any:
    """The `gguf` package; a UserError naming the extra that installs it when it is missing."""
    try:
        import gguf
    except ImportError:
        raise UserError(f"GGUF files are written and read with llama.cpp's gguf package, which is not installed: "
                        f"{INSTALL}") from None  # fmt: skip
    return gguf
