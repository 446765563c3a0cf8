"""Test-session settings shared by in-process runs and the CLI subprocesses they start."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the whole test session (never the user's own): runs of the same config
# compile the same programs, and JAX reuses them instead of compiling again (most of a short run's time on two
# cores). The process that loads this first (pytest itself, before it starts the xdist workers) makes it and
# removes it at exit; the workers and every subprocess inherit it through the environment, so a program one
# worker compiled is not compiled again by the other.
_SESSION = "NNX_TESTS_COMPILATION_CACHE"
if _SESSION not in os.environ:
    os.environ[_SESSION] = tempfile.mkdtemp(prefix="nnx-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ[_SESSION], ignore_errors=True)
os.environ["NNX_COMPILATION_CACHE"] = os.environ[_SESSION]

# In-process tests compile through the same cache: many build the same small models and jit the same programs.
from nnx_cli.runtime import cache_compilations  # noqa: E402

cache_compilations(os.environ[_SESSION])
