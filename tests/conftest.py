"""Test-session settings shared by in-process runs and the CLI subprocesses they start."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
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

# The tests compile far more than they run: test_lm_decoding and test_lm_model spent 85 s of their 101 s compiling.
# XLA's backend at optimisation level 0 (LLVM unoptimised; the matmuls are library calls either way) compiles in
# about half the time (72 s of XLA compiling to 39 s there), and the whole suite went from 10:57 to 8:38 on 2 cores.
# Users' runs and the benchmarks keep the default. Every process of the session (workers, CLI subprocesses, the
# multi-device scripts) gets the same flag, so that results compared across processes come from programs compiled
# alike; the exception is test_cli_lm's two 100-step runs, compared only with each other, which execute more than
# they compile and drop it (cli_support.optimized_flags).
# XLA's CPU fusion emitters (its newer code generator for fused element-wise work) compile more slowly than the
# older emitters on these tiny programs: without them test_lm_model and test_lm_decoding took 34 s instead of 53 s
# on 2 cores (a 20-step CLI run: 3.1 s of compiling instead of 4.6, 0.5 s more running). Same flags everywhere,
# dropped together by cli_support.optimized_flags.
# XLA's CPU backend splits each program's LLVM module into parts compiled on threads of their own: on these small
# programs the split costs more than the threads save. One part: 23% less CPU time compiling (0.40 s against
# 0.52 s a program, three small transformer_lm gradients, alternated over nine runs each on 2 cores); at XLA's
# default optimisation level it makes no difference either way, so the long runs keep it.
# XLA aborts a process whose XLA_FLAGS name a flag it does not know, and it retires flags as it goes (the CPU
# fusion emitters' switch is due to go with the older emitters): the process that starts the session asks a
# jaxlib of its own (about a second) and keeps the flags it accepts; workers and subprocesses inherit the result.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
_CHECKED = "NNX_TESTS_XLA_FLAGS_CHECKED"


def _accepted(flags: list[str]) -> bool:
    probe = "import jax; jax.devices()"
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if _CHECKED not in os.environ:
    _missing = [flag for flag in _FAST_COMPILE if flag not in os.environ.get("XLA_FLAGS", "")]
    if _missing and not _accepted(_missing):
        _missing = [flag for flag in _missing if _accepted([flag])]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_missing]).strip()
    os.environ[_CHECKED] = "1"

# One precision policy: float32 products at float32 precision in every process of the session, so that the
# tolerances of tests comparing float32 numbers with a reference (transformers' logits, plain attention, the
# same model another way) hold on every platform. A GPU's default multiplies float32 in TF32 or bfloat16 passes
# (the tests missed 1e-4 by 5e-4 to 2e-3 there); a CPU's is float32 already, so this costs it nothing. The
# environment carries it into the workers and every subprocess; bfloat16 products are unaffected.
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

# The commands that compute start their process again with glibc's malloc asking for huge pages (nnx_cli.runtime):
# the session sets what they would, once, so that every process runs as a user's does and none starts again (the
# fork server's commands would lose their imports, paid once in the server). Workers and subprocesses inherit it.
from nnx_cli import runtime  # noqa: E402

_relaunch = runtime.huge_pages_environment(os.environ, runtime.transparent_huge_pages(), runtime.glibc_version())
if _relaunch is not None:
    os.environ["GLIBC_TUNABLES"] = _relaunch["GLIBC_TUNABLES"]

# In-process tests compile through the same cache: many build the same small models and jit the same programs.
import jax  # noqa: E402
import pytest  # noqa: E402

from nnx_cli.runtime import cache_compilations  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # had jax been imported before the variable was set
cache_compilations(os.environ[_SESSION])


# Each file's tests run on one worker (`--dist loadscope` in pyproject.toml), so that a module's shared fixtures
# (a 100-step reference run, a model trained once for a dozen tests) are made once, not once per worker that got
# one of its tests (1,275 s of tests in 654 s on 2 cores, from 679 s handed out test by test). xdist hands out the
# files with the most tests first, which leaves the files that run the most commands (the documentation's pages,
# the language-model and multi-process runs) to the end; handing those out first instead ran them at once, their
# subprocesses contending for the cores, and the whole suite took 941 s on 2 cores against 746 s.


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` starts one worker more than this process may use cores (`--maxprocesses` caps it): a worker
    waiting on its subprocess, a checkpoint write or a peer process leaves its core to the extra one. The whole
    suite on 2 cores, one run each: 625 s with 2 workers, 579 s with 3, 574 s with 4 (3 keeps the memory of one
    worker fewer)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


@pytest.fixture
def on_the_cpu():
    """The test's arrays and programs on the CPU device, whatever the default device: for tests of what XLA's CPU
    backend is given (a transformation the trainer applies on a CPU only), run on a GPU machine too."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield
