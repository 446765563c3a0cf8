"""JAX's persistent compilation cache under the command-line tools: on by default, in a chosen directory, or off."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from cli_support import cli, final_state, optimized_flags

from nnx_cli import runtime
from nnx_cli.runtime import compilation_cache_dir, huge_pages_environment

RUN = ["model.hidden_sizes=[16]", "model.latent_size=2", "train.batch_size=32", "train.steps=4"]


def test_the_cache_directory_comes_from_the_environment(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("NNX_COMPILATION_CACHE", str(tmp_path / "here"))
    assert compilation_cache_dir() == tmp_path / "here"
    monkeypatch.setenv("NNX_COMPILATION_CACHE", "off")
    assert compilation_cache_dir() is None
    monkeypatch.delenv("NNX_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache_dir() == tmp_path / "xdg" / "nnx" / "jax"


def test_a_second_run_of_a_config_compiles_nothing_new(tmp_path: Path):
    (tmp_path / "run.yaml").write_text("{}\n")
    cache = tmp_path / "cache"
    first = cli(
        "nnx-train", "run.yaml", *RUN, "--workdir", "a", cwd=tmp_path, extra_env={"NNX_COMPILATION_CACHE": str(cache)}
    )
    assert first.returncode == 0, first.stderr
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) >= 3  # init, the train dispatch, eval, ... even though each compiles in well under a second
    second = cli(
        "nnx-train", "run.yaml", *RUN, "--workdir", "b", cwd=tmp_path, extra_env={"NNX_COMPILATION_CACHE": str(cache)}
    )
    assert second.returncode == 0, second.stderr
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_off_writes_no_cache(tmp_path: Path):
    (tmp_path / "run.yaml").write_text("{}\n")
    result = cli(
        "nnx-train",
        "run.yaml",
        *RUN,
        "--workdir",
        "a",
        cwd=tmp_path,
        extra_env={"NNX_COMPILATION_CACHE": "off", "XDG_CACHE_HOME": str(tmp_path / "xdg")},
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "xdg").exists()


def test_a_fresh_run_draws_the_same_parameters_whatever_xla_backend_it_compiles_with(tmp_path: Path):
    """The initialiser runs once, at XLA's optimisation level 0 on a CPU (`steps.jit_drawing`): the optimised
    backend would round some draws another way, so the suite's processes (level 0) would check other values
    than users get, and a resumed run could not draw its reference again in a process with other flags."""
    (tmp_path / "run.yaml").write_text("{}\n")
    unmoved = ["train.steps=1", "optimizer.learning_rate=0.0", "checkpoint.every_steps=1"]  # params stay as drawn
    drawn = []
    for name, flags in [("optimised", optimized_flags()), ("suite", None)]:
        extra = {"NNX_COMPILATION_CACHE": "off", **({"XLA_FLAGS": flags} if flags is not None else {})}
        result = cli("nnx-train", "run.yaml", *unmoved, "--workdir", name, cwd=tmp_path, extra_env=extra)
        assert result.returncode == 0, result.stderr
        drawn.append(jax.tree.leaves(final_state(tmp_path / name)["params"]))
    assert len(drawn[0]) == len(drawn[1]) > 0
    for a, b in zip(*drawn):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_huge_pages_are_asked_for_only_where_glibc_and_the_kernel_take_the_request():
    out = huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"}, "madvise", (2, 36))
    assert out is not None and out["HOME"] == "/h"
    assert out["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert huge_pages_environment(out, "madvise", (2, 36)) is None  # started again once, never twice
    assert huge_pages_environment({}, "madvise", (2, 35))["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    for kernel, glibc in [("always", (2, 36)), ("never", (2, 36)), (None, (2, 36)), ("madvise", (2, 34)),
                          ("madvise", None)]:  # fmt: skip
        assert huge_pages_environment({}, kernel, glibc) is None, (kernel, glibc)
    assert huge_pages_environment({"NNX_HUGE_PAGES": "off"}, "madvise", (2, 36)) is None
    assert huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36)) is None


def test_a_training_run_starts_again_with_huge_pages_where_they_help_and_says_so_in_run_json(tmp_path, monkeypatch):
    """The console script starts its process again (same arguments) with the tunable, unless told not to. Run
    as installed, not through the fork server (whose forked commands carry the server's own malloc)."""
    monkeypatch.setenv("NNX_TESTS_FORKSERVER", "0")
    (tmp_path / "run.yaml").write_text("{}\n")
    here = huge_pages_environment({}, runtime.transparent_huge_pages(), runtime.glibc_version()) is not None
    for name, extra in [("asked", {}), ("off", {"NNX_HUGE_PAGES": "off"})]:
        result = cli("nnx-train", "run.yaml", *RUN, "--workdir", name, cwd=tmp_path,
                     extra_env={"GLIBC_TUNABLES": "", **extra})  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "done: 4 steps" in result.stderr
        info = json.loads((tmp_path / name / "run.json").read_text())
        assert info["huge_pages"] is (here and name == "asked"), (name, here)
        assert info["command"][1:] == ["run.yaml", *RUN, "--workdir", name]
