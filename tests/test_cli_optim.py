"""Optax optimizers and schedules chosen by name in the `optimizer` section."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

from nnx_cli.config import OptimizerConfig
from nnx_cli.errors import UserError
from nnx_cli.optim import build_optimizer, build_schedule, optimizer_names


def test_every_common_optax_optimizer_is_available():
    assert {"adam", "adamw", "sgd", "lion", "rmsprop", "adafactor"} <= set(optimizer_names())


def test_optimizer_options_are_passed_to_optax():
    tx = build_optimizer(OptimizerConfig(name="sgd", learning_rate=0.5, options={"momentum": 0.9}), 100)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert jnp.allclose(updates["w"], -0.5 * 1.9)  # momentum: 1 + 0.9 * 1


def test_schedule_by_name_with_and_without_suffix():
    a = build_schedule({"name": "linear", "init_value": 1.0, "end_value": 0.0, "transition_steps": 10}, 100)
    b = build_schedule({"name": "linear_schedule", "init_value": 1.0, "end_value": 0.0, "transition_steps": 10}, 100)
    assert float(a(5)) == pytest.approx(0.5) == float(b(5))


def test_missing_decay_steps_default_to_the_run_length():
    schedule = build_schedule({"name": "cosine_decay", "init_value": 1.0}, 100)
    assert float(schedule(100)) == pytest.approx(0.0, abs=1e-6)
    assert float(schedule(50)) == pytest.approx(0.5, abs=1e-6)


def test_without_run_length_a_schedule_keeps_the_optimizer_state_structure():
    import jax

    spec = {"name": "warmup_cosine_decay", "init_value": 0.0, "peak_value": 1e-3, "warmup_steps": 200}
    params = {"w": jnp.zeros(3)}
    real = build_optimizer(OptimizerConfig(name="adamw", learning_rate=spec), 1000).init(params)
    placeholder = build_optimizer(OptimizerConfig(name="adamw", learning_rate=spec), None).init(params)
    assert jax.tree.structure(real) == jax.tree.structure(placeholder)


def test_clip_grad_norm_bounds_the_update():
    tx = build_optimizer(OptimizerConfig(name="sgd", learning_rate=1.0, clip_grad_norm=1.0), 10)
    params = {"w": jnp.zeros(4)}
    updates, _ = tx.update({"w": jnp.full(4, 10.0)}, tx.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-5)


def test_unknown_optimizer_suggests_closest():
    with pytest.raises(UserError, match=r"unknown optax optimizer 'adamww' \(did you mean 'adamw'\?\)"):
        build_optimizer(OptimizerConfig(name="adamww"), 10)


def test_unknown_optimizer_option_suggests_closest():
    with pytest.raises(
        UserError, match=r"'optimizer\.weight_decy' for optax\.adamw \(did you mean 'optimizer\.weight_decay'\?\)"
    ):
        build_optimizer(OptimizerConfig(name="adamw", options={"weight_decy": 0.1}), 10)


def test_unknown_schedule_suggests_closest():
    with pytest.raises(UserError, match=r"unknown optax schedule 'cosine_decya' \(did you mean 'cosine_decay'\?\)"):
        build_schedule({"name": "cosine_decya", "init_value": 1.0}, 10)
