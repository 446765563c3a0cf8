"""Optax optimizers and schedules chosen by name in the `optimizer` section."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from nnx_cli.config import OptimizerConfig
from nnx_cli.errors import UserError
from nnx_cli.optim import build, build_optimizer, build_schedule, optimizer_names


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


def test_a_schedule_optax_names_without_the_suffix_is_found_with_or_without_it():
    spec = {"init_value": 0.01, "transition_steps": 2, "decay_rate": 0.5}
    for name in ("exponential_decay", "exponential_decay_schedule"):
        assert float(build_schedule({"name": name, **spec}, 10)(2)) == pytest.approx(0.005)


def test_a_warmup_longer_than_the_run_names_warmup_steps_and_train_steps():
    """The message quoted optax's "got decay_steps=-196" (its decay after the warmup) beside "decay_steps is the
    run length, 4 steps": two numbers for one name."""
    spec = {"name": "warmup_cosine_decay", "init_value": 0.0, "peak_value": 2e-3, "warmup_steps": 200}
    with pytest.raises(UserError) as raised:
        build_schedule(spec, 4)
    assert str(raised.value) == (
        "config key 'optimizer.learning_rate': warmup_steps (200) must be below decay_steps (4: the run length, 4 "
        "steps, as the config leaves it out), which counts the warmup too; lower "
        "optimizer.learning_rate.warmup_steps or raise train.steps"
    )
    with pytest.raises(UserError, match=r"warmup_steps \(4\) must be below decay_steps \(4: its own\), which counts "
                       r"the warmup too; lower optimizer.learning_rate.warmup_steps or raise "
                       r"optimizer.learning_rate.decay_steps$"):  # fmt: skip
        build_schedule({**spec, "warmup_steps": 4, "decay_steps": 4}, 100)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"name": "constant", "value": -0.01},
            r"^config key 'optimizer.learning_rate': the schedule gives -0\.01 at step 1; a learning rate must be a "
            r"finite number, zero or more \(a negative rate climbs the loss\)$",
        ),
        (  # the sign changes half-way: the last steps climb the loss
            {"name": "linear", "init_value": 0.01, "end_value": -0.02, "transition_steps": 10},
            r"the schedule gives -0\.002 at step 5; a learning rate",
        ),
        (  # optax's onecycle schedules take no array of steps: each is looked at alone
            {"name": "cosine_onecycle", "transition_steps": 20, "peak_value": -0.1},
            r"the schedule gives -0\.004 at step 1",
        ),
        (
            {"name": "exponential_decay", "init_value": 0.01, "transition_steps": 1, "decay_rate": 1e30},
            r"the schedule gives inf at step 3",
        ),
        (  # optax ran a constant 0.01 for the whole run
            {"name": "linear", "init_value": 0.01, "end_value": 0.0, "transition_steps": -5},
            r"config key 'optimizer.learning_rate.transition_steps' counts steps: 0 or more, got -5",
        ),
    ],
    ids=["negative-constant", "turns-negative", "onecycle", "overflows", "negative-count"],
)
def test_a_schedule_that_gives_a_negative_or_non_finite_rate_during_the_run_is_refused(spec, message):
    """A negative constant rate was refused, but the same rate as a schedule trained on: the loss climbed."""
    with pytest.raises(UserError, match=message):
        build_schedule(spec, 20)
    assert float(build_schedule({"name": "constant", "value": 0.0}, 20)(3)) == 0.0  # zero is a rate


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


def test_an_optimizer_whose_update_needs_the_loss_is_refused_saying_so():
    """optax.lbfgs was offered among the optimizers, and failed at the first update with a TypeError (update_fn()
    missing 3 required keyword-only arguments)."""
    assert "lbfgs" not in optimizer_names()
    with pytest.raises(UserError, match=r"^config key 'optimizer.name': optax.lbfgs takes the loss, its gradient"):
        build(OptimizerConfig(name="lbfgs"), 10)


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


def test_a_chain_of_optax_pieces_gets_the_sections_learning_rate():
    chain = [{"name": "scale_by_adam", "b2": 0.99}, {"name": "scale_by_learning_rate"}]
    tx, lr = build(OptimizerConfig(learning_rate=0.5, chain=chain), 10)
    reference = optax.chain(optax.scale_by_adam(b2=0.99), optax.scale_by_learning_rate(0.5))
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.asarray([1.0, -2.0, 3.0])}
    ours, _ = tx.update(grads, tx.init(params), params)
    theirs, _ = reference.update(grads, reference.init(params), params)
    assert jnp.array_equal(ours["w"], theirs["w"]) and lr == 0.5


def test_a_chain_and_an_optimizer_name_are_exclusive():
    with pytest.raises(UserError, match=r"'optimizer\.name' \('adam'\) and 'optimizer\.chain' are both set"):
        build(OptimizerConfig(name="adam", chain=[{"name": "scale_by_adam"}]), 10)


def test_an_empty_chain_is_a_user_error_naming_the_key():
    with pytest.raises(UserError, match=r"config key 'optimizer\.chain' is empty: list the optax pieces"):
        build(OptimizerConfig(name=None, chain=[]), 10)


def test_a_chain_piece_option_is_checked_against_its_signature():
    with pytest.raises(UserError, match=r"'optimizer\.chain\[1\]\.b3' for optax\.scale_by_adam"):
        build(OptimizerConfig(chain=[{"name": "clip", "max_delta": 1.0}, {"name": "scale_by_adam", "b3": 0.9}]), 10)
    with pytest.raises(UserError, match=r"unknown optax function 'scale_by_adamm' \(did you mean 'scale_by_adam'\?\)"):
        build(OptimizerConfig(chain=[{"name": "scale_by_adamm"}]), 10)


def test_an_optimizer_factory_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "my_optim.py").write_text(
        "import optax\n\n"
        "def make(learning_rate, momentum=0.0):\n"
        "    return optax.sgd(learning_rate, momentum=momentum)\n"
    )
    monkeypatch.chdir(tmp_path)
    tx, _ = build(OptimizerConfig(name="my_optim:make", learning_rate=0.5, options={"momentum": 0.9}), 10)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
    updates, _ = tx.update({"w": jnp.ones(2)}, state, params)
    assert jnp.allclose(updates["w"], -0.5 * 1.9)
    with pytest.raises(UserError, match=r"unknown config key 'optimizer\.nesterov' for my_optim:make"):
        build(OptimizerConfig(name="my_optim:make", options={"nesterov": True}), 10)


def test_an_optimizer_factorys_annotated_options_are_type_checked_and_one_without_a_rate_says_so(
    tmp_path, monkeypatch, capfd
):
    """momentum=x failed inside optax ('Only integer scalar arrays...'); a factory taking no learning_rate ran
    without it while the log showed the config's."""
    (tmp_path / "nnx_test_typed_optim.py").write_text(
        "import optax\n\n"
        "def make(learning_rate, momentum: float = 0.0):\n"
        "    return optax.sgd(learning_rate, momentum=momentum)\n\n"
        "def fixed(momentum: float = 0.9):\n"
        "    return optax.sgd(0.01, momentum=momentum)\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^config key 'optimizer\.momentum' must be"):
        build(OptimizerConfig(name="nnx_test_typed_optim:make", options={"momentum": "x"}), 10)
    build(OptimizerConfig(name="nnx_test_typed_optim:fixed", learning_rate=0.5), 10)
    said = capfd.readouterr().err
    assert "notice: nnx_test_typed_optim:fixed takes no learning_rate: optimizer.learning_rate is not used" in said


@pytest.mark.parametrize(
    "cfg",
    [
        OptimizerConfig(name="adamw", learning_rate=0.1, options={"weight_decay": 0.5}),
        OptimizerConfig(name=None, learning_rate=0.1, chain=[{"name": "adamw", "weight_decay": 0.5}]),
        OptimizerConfig(
            name=None,
            learning_rate=0.1,
            chain=[
                {"name": "scale_by_adam"},
                {"name": "add_decayed_weights", "weight_decay": 0.5},
                {"name": "scale_by_learning_rate"},
            ],
        ),
        OptimizerConfig(
            name="adafactor",
            learning_rate=0.1,
            options={"weight_decay_rate": 0.5, "multiply_by_parameter_scale": False, "clipping_threshold": None},
        ),
    ],
    ids=["adamw", "adamw-in-a-chain", "add-decayed-weights", "adafactor"],
)
def test_weight_decay_mask_kernels_decays_matrices_but_not_biases(cfg):
    """In a chain, an adamw (or lion, ...) piece decayed every parameter with the mask set: it reached
    add_decayed_weights alone. Adafactor names its mask weight_decay_mask: it was refused."""
    import dataclasses

    import nnx

    params = nnx.Linear(2, 3, ctx=nnx.context(0)).filter(nnx.Param)
    params = jax.tree.map(jnp.ones_like, params)
    zero = jax.tree.map(jnp.zeros_like, params)
    tx, _ = build(dataclasses.replace(cfg, weight_decay_mask="kernels"), 10)
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(jnp.abs(updates["kernel"].value).min()) > 0.01 and jnp.allclose(updates["bias"].value, 0.0)
    tx, _ = build(cfg, 10)  # all: the bias decays too
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(jnp.abs(updates["bias"].value).min()) > 0.01


def test_weight_decay_mask_set_twice_or_on_a_chain_without_weight_decay_is_refused():
    with pytest.raises(UserError, match=r"'optimizer.mask' and 'optimizer.weight_decay_mask' both say which"):
        build(OptimizerConfig(name="adamw", weight_decay_mask="kernels", options={"mask": None}), 10)
    chain = [{"name": "scale_by_adam"}, {"name": "scale_by_learning_rate"}]  # the key did nothing
    with pytest.raises(UserError, match=r"'optimizer.weight_decay_mask' is kernels, but no piece of optimizer.chain"):
        build(OptimizerConfig(name=None, chain=chain, weight_decay_mask="kernels"), 10)


def test_a_chain_that_takes_no_learning_rate_says_the_logged_one_is_not_used(capfd):
    build(OptimizerConfig(name=None, chain=[{"name": "scale_by_adam"}, {"name": "scale", "step_size": -1e-4}]), 10)
    assert "notice: no piece of optimizer.chain takes a learning_rate" in capfd.readouterr().err
    build(OptimizerConfig(name=None, chain=[{"name": "scale_by_adam"}, {"name": "scale_by_learning_rate"}]), 10)
    assert "notice" not in capfd.readouterr().err


def test_weight_decay_mask_needs_an_optimizer_with_weight_decay():
    with pytest.raises(UserError, match="optax.adam takes no weight-decay mask"):
        build(OptimizerConfig(name="adam", weight_decay_mask="kernels"), 10)


def test_weight_decay_mask_kernels_leaves_stacked_biases_and_norms_alone():
    import nnx
    from nnx_cli.config import ModelConfig
    from nnx_cli.data.base import DataSpec
    from nnx_cli.models import model_factory
    from nnx_cli.optim import _kernels_only

    options = {"num_layers": 2, "num_heads": 2, "embed_dim": 32}
    build = model_factory(ModelConfig(name="transformer_lm", options=options), DataSpec((16,), 257, "bytes"))
    params = jax.eval_shape(lambda: build(nnx.context(0)).filter(nnx.Param))
    decayed = {path for path, node in _kernels_only(params).items() if node.value}
    assert "layers/scan_module/mlp/fc/kernel" in decayed and "embedding/embedding" in decayed
    assert "layers/scan_module/attention/query/bias" not in decayed  # (layers, heads, kv): a bias all the same
    assert "layers/scan_module/mlp_norm/scale" not in decayed and "final_norm/bias" not in decayed


def test_an_optimizer_factory_that_raises_is_a_user_error_naming_the_key(tmp_path, monkeypatch):
    (tmp_path / "nnx_test_bad_optim.py").write_text("def make(learning_rate):\n    raise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError, match=r"^config key 'optimizer\.name': nnx_test_bad_optim:make raised RuntimeError: boom; fix it"
    ):
        build(OptimizerConfig(name="nnx_test_bad_optim:make"), 10)


@pytest.mark.parametrize("name", optimizer_names())
def test_every_optimizer_states_placement_fits_its_arrays(name):
    """Adafactor's factored statistics of a matrix are vectors (and size-1 placeholders for a vector) under the
    parameter's Variable: placed with the parameter's spec, jit refused them ('only valid for values of rank at
    least 2'); they are kept whole now, and a placed state steps."""
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup

    options = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=8",
               "data.text_key=text", "data.seq_len=16", f"optimizer.name={name}"]  # fmt: skip
    exp = setup(load_config(None, options), data=None)
    state = jax.jit(lambda: jax.tree.map(jnp.zeros_like, exp.abstract), out_shardings=exp.shardings)()
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(exp.shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (OptimizerConfig(name="adam", options={"b1": "high"}), r"'optimizer.b1' must be a number for optax.adam, got"),
        (OptimizerConfig(name="sgd", options={"momentum": "lots"}), r"'optimizer.momentum' must be a number for optax"),
        (
            OptimizerConfig(learning_rate={"name": "cosine_decay", "init_value": "fast"}),
            r"'optimizer.learning_rate.init_value' must be a number for optax.cosine_decay_schedule, got 'fast'",
        ),
        (
            OptimizerConfig(
                name=None, chain=[{"name": "scale_by_adam", "b2": "fast"}, {"name": "scale_by_learning_rate"}]
            ),
            r"'optimizer.chain\[0\].b2' must be a number for optax.scale_by_adam",
        ),
    ],
    ids=["option", "option-defaulting-to-none", "schedule", "chain-piece"],
)
def test_text_where_optax_takes_a_number_names_the_key(cfg, message):
    """It was "config section 'optimizer': the optimizer cannot update the parameters: TypeError: unsupported
    operand type(s) for -: 'int' and 'str'", naming no key."""
    with pytest.raises(UserError, match=message):
        build(cfg, 10)
    build(OptimizerConfig(name="adamw", options={"weight_decay": 0.1, "mask": None}), 10)  # numbers and null pass
