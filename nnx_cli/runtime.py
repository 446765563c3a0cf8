"""How JAX runs under the command-line tools: the persistent compilation cache, deterministic GPU kernels.

Compiling is most of a short run's time, and the same config compiles the
same programs every time, so every command keeps JAX's persistent
compilation cache on: in `$XDG_CACHE_HOME/nnx/jax` (`~/.cache/nnx/jax`) by
default, in the directory `NNX_COMPILATION_CACHE` names, or nowhere with
`NNX_COMPILATION_CACHE=off`. Its thresholds are lowered so that the small
programs of small models are cached too.
"""

from __future__ import annotations

import os
from pathlib import Path

_ENV = "NNX_COMPILATION_CACHE"


def compilation_cache_dir() -> Path | None:
    """Where compiled programs are kept (None: `NNX_COMPILATION_CACHE=off`)."""
    setting = os.environ.get(_ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "none"):
        return None
    if setting:
        return Path(setting).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "nnx" / "jax"


def configure(*, deterministic: bool = False) -> None:
    """Set up JAX for a command: the compilation cache, and with `deterministic` XLA's deterministic GPU ops.

    Call it before the first computation (deterministic ops must be chosen
    before the GPU backend starts).
    """
    import jax

    if deterministic and "--xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    directory = compilation_cache_dir()
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
