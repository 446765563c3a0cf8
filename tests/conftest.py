"""Test-session settings shared by in-process runs and the CLI subprocesses they start."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the whole test session (never the user's own): runs of the same config
# compile the same programs, and JAX reuses them instead of compiling again (most of a short run's time on two
# cores). Subprocesses inherit it through the environment.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="nnx-tests-jax-cache-")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
os.environ["NNX_COMPILATION_CACHE"] = _COMPILATION_CACHE
