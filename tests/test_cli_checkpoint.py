"""Orbax checkpoints of a train state: round trips, retention, periodic saves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnx
from nnx_cli.checkpoint import Checkpointer, to_named_tree


def train_state(seed: int = 0):
    model = nnx.Linear(3, 4, ctx=nnx.context(seed))
    (params, rest), _ = model.partition(nnx.Param, ...)
    params = jax.tree.map(lambda x: x + seed, params)
    return {
        "step": jnp.asarray(seed, jnp.int32),
        "params": params,
        "opt_state": optax.adam(1e-3).init(params),
        "rest": rest,
    }


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_gives_back_the_saved_state_in_its_structure(tmp_path):
    state = train_state(seed=7)
    ckpt = Checkpointer(tmp_path / "ckpt", async_=True)
    ckpt.save(7, state)
    ckpt.wait()
    restored = ckpt.restore(7, jax.eval_shape(lambda: state))
    assert_trees_equal(restored, state)
    ckpt.close()


def test_checkpoint_names_follow_state_paths(tmp_path):
    names = to_named_tree(train_state())
    assert set(names["params"]) == {"bias", "kernel"}
    assert set(names["opt_state"]["0"]) == {"count", "mu", "nu"}


def test_only_the_last_keep_checkpoints_remain(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, async_=False)
    for step in (1, 2, 3, 4):
        ckpt.save(step, train_state(step))
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "4"]


def test_raw_restore_needs_no_target(tmp_path):
    state = train_state(seed=2)
    ckpt = Checkpointer(tmp_path / "ckpt", async_=False)
    ckpt.save(2, state)
    raw = ckpt.restore_raw(2)
    np.testing.assert_array_equal(raw["params"]["kernel"], state["params"]["kernel"].value)


def test_what_a_killed_save_left_is_removed_by_the_next_writer_and_kept_by_readers(tmp_path):
    """`<step>.orbax-checkpoint-tmp-*` directories (a save cut off by kill -9 or a crash) stayed in the work dir for
    good, a copy of the state each."""
    ckpt = Checkpointer(tmp_path / "ckpt", async_=False)
    ckpt.save(1, train_state(1))
    ckpt.wait()
    ckpt.close()
    leftover = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1764000000"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "part").write_bytes(b"half a save")
    reader = Checkpointer(tmp_path / "ckpt", read_only=True)
    assert reader.all_steps() == [1] and leftover.exists()  # nnx-eval and nnx-inspect change nothing
    reader.close()
    writer = Checkpointer(tmp_path / "ckpt", async_=False)
    assert writer.all_steps() == [1]
    writer.save(3, train_state(3))
    writer.wait()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "3"]
    writer.close()
