"""Where arrays live: mesh shapes, state shardings from logical axes, batch layouts (called directly).

Several devices are simulated in a subprocess (`--xla_force_host_platform_device_count=8`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from cli_support import ROOT, assert_user_error, cli

from nnx_cli.config import ShardingConfig
from nnx_cli.errors import UserError
from nnx_cli.sharding import DEFAULT_RULES, axis_rules, batch_layout, make_mesh, mesh_shape


def test_minus_one_takes_the_remaining_devices():
    assert mesh_shape(ShardingConfig(mesh={"data": -1, "model": 2}), 8) == {"data": 4, "model": 2}


def test_a_mesh_that_does_not_fit_says_which_override_fixes_it():
    with pytest.raises(
        UserError, match=r"does not fit the 8 available device\(s\).*sharding\.mesh\.data=-1 sharding\.mesh\.model=1"
    ):
        mesh_shape(ShardingConfig(mesh={"data": 3, "model": 2}), 8)


def test_an_empty_mesh_that_does_not_fit_suggests_a_data_axis():
    with pytest.raises(UserError, match=r"for example sharding\.mesh\.data=-1 \(-1: all remaining devices\)$"):
        mesh_shape(ShardingConfig(mesh={}), 8)


@pytest.mark.parametrize(
    "sharding, message",
    [
        (
            {"rules": [["batch", "data"], ["hidden", ["model", "model"]]]},
            r"'sharding.rules\[1\]' names mesh axis "
            r"'model' twice",
        ),
        ({"rules": [["batch", ["data", None]]]}, r"'sharding.rules\[0\]' must be \[logical_axis, mesh_axis or null\]"),
        ({"rules": [["batch", [None]]]}, r"'sharding.rules\[0\]' must be"),
        ({"rules": [["batch", []]]}, r"'sharding.rules\[0\]' must be"),
        ({"mesh": {"data": -1, "model": -1}}, r"at most one axis may be -1 \(the rest of the devices\), got \{'data'"),
        ({"mesh": {1: 8}}, r"'sharding.mesh' must be a mapping of strings to integers, got \{.*1: 8\}"),
    ],
    ids=["axis-twice", "null-in-a-list", "only-null", "empty-list", "two-minus-ones", "axis-not-a-name"],
)
def test_rules_and_meshes_that_jax_cannot_take_are_refused_naming_the_entry(sharding, message):
    """A mesh axis twice in one rule, or null in a list of mesh axes, passed the check and ended in a traceback
    (JAX's DuplicateSpecError, a KeyError or a TypeError) when the run placed its arrays."""
    from nnx_cli.config import Config, from_dict, merge, to_dict

    with pytest.raises(UserError, match=message):
        from_dict(merge(to_dict(Config()), {"sharding": sharding}))


def test_null_rules_are_the_default_rules():
    assert axis_rules(ShardingConfig(rules=None)) == [tuple(r) for r in DEFAULT_RULES]
    assert axis_rules(ShardingConfig(rules=[["embed", ["data", "model"]]])) == [("embed", ("data", "model"))]


def test_one_device_layout_places_whole_batches_and_stacked_dispatches():
    layout = batch_layout(make_mesh(ShardingConfig()), axis_rules(ShardingConfig()), 4)
    assert layout.rows == slice(0, 4)
    placed = layout.place({"x": np.arange(12.0).reshape(3, 4)}, stacked=True)
    assert placed["x"].shape == (3, 4) and placed["x"].sharding.spec == jax.sharding.PartitionSpec(None, "data")


_EIGHT_DEVICES = textwrap.dedent(
    """
    import jax, numpy as np
    import nnx
    from nnx_cli.config import ShardingConfig
    from nnx_cli.errors import UserError
    from nnx_cli.sharding import axis_rules, batch_layout, make_mesh, state_shardings

    cfg = ShardingConfig(mesh={"data": 4, "model": 2})
    mesh, rules = make_mesh(cfg), axis_rules(cfg)
    layout = batch_layout(mesh, rules, 8)
    placed = layout.place({"x": np.arange(16.0).reshape(2, 8)}, stacked=True)
    print("rows", [s.data.shape for s in placed["x"].addressable_shards][:2])
    try:
        batch_layout(mesh, rules, 6)
    except UserError as e:
        print("batch", e)
    init = nnx.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    def params(width):
        return jax.eval_shape(lambda: nnx.Linear(3, width, kernel_init=init, ctx=nnx.context(0)).filter(nnx.Param))

    print("spec", tuple(state_shardings(params(6), mesh, rules)["kernel"].value.spec))
    odd = params(5)
    try:
        state_shardings(odd, mesh, rules)
    except UserError as e:
        print("odd", e)
    """
)


def on_eight_devices(script: str) -> dict[str, str]:
    """What `script` prints (`name value` lines) run in a process of its own with 8 simulated CPU devices."""
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "",
        "JAX_DEFAULT_MATMUL_PRECISION": os.environ["JAX_DEFAULT_MATMUL_PRECISION"],
    }  # conftest.py's policy
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def test_batches_and_parameters_split_over_eight_devices():
    lines = on_eight_devices(_EIGHT_DEVICES)
    assert lines["rows"] == "[(2, 2), (2, 2)]"  # each of 4 data shards holds 2 rows of both stacked batches
    assert "'train.batch_size' (6) must be divisible by the 4 ways" in lines["batch"]
    assert lines["spec"] == "(None, 'model')"
    assert "kernel [3, 5] cannot be split" in lines["odd"] and "map 'hidden' to null in sharding.rules" in lines["odd"]


_REPLICATING = textwrap.dedent(
    """
    import jax
    import nnx
    from nnx_cli.config import ShardingConfig
    from nnx_cli.errors import UserError
    from nnx_cli.sharding import axis_rules, make_mesh, state_shardings

    init = nnx.with_logical_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    params = jax.eval_shape(lambda: nnx.Linear(4, 8, kernel_init=init, ctx=nnx.context(0)).filter(nnx.Param))
    cases = {
        "typo": ({"data": 4, "model": 2}, [["batch", "data"], ["hiddn", "model"]]),
        "no_batch_rule": ({"batch": 8}, []),
        "unused_axis": ({"data": 4, "fsdp": 2}, [["batch", "data"]]),
        "axis_typo": ({"data": 4, "model": 1, "modl": 2}, [["batch", "data"], ["hidden", "model"]]),
        "harmless": ({"data": 4, "model": 2}, [["batch", "data"], ["hidden", "model"], ["expert", "model"]]),
        "indivisible": ({"data": 1, "foo": 8}, [["batch", "data"]]),  # embed is 4: the rule offered splits hidden
    }
    for name, (mesh, rules) in cases.items():
        cfg = ShardingConfig(mesh=mesh, rules=rules)
        try:
            state_shardings(params, make_mesh(cfg), axis_rules(cfg))
            print(name, "ok")
        except UserError as e:
            print(name, e)
    """
)


@pytest.fixture(scope="module")
def replicating() -> dict[str, str]:
    return on_eight_devices(_REPLICATING)


def test_a_rule_for_a_logical_axis_the_model_lacks_suggests_the_closest(replicating: dict[str, str]):
    assert replicating["typo"] == (
        "config key 'sharding.rules[1]' maps logical axis 'hiddn', which no parameter or activation of the model "
        "has (did you mean 'hidden'?); its parameters' logical axes: embed, hidden"
    )


def test_a_mesh_axis_no_rule_maps_to_says_which_rule_would_use_it(replicating: dict[str, str]):
    assert replicating["no_batch_rule"].startswith("config key 'sharding.mesh': axis 'batch' has 8 devices")
    assert "for example sharding.rules=[[batch, batch]]" in replicating["no_batch_rule"]
    assert "axis 'fsdp' has 2 devices but sharding.rules [[batch, data]] map no" in replicating["unused_axis"]
    assert "for example sharding.rules=[[batch, data], [embed, fsdp]]" in replicating["unused_axis"]
    assert replicating["axis_typo"].startswith(
        "config key 'sharding.mesh': axis 'modl' (did you mean 'model'?) has 2 devices"
    )  # it suggested only a rule for 'modl'
    assert "for example sharding.rules=[[batch, data], [hidden, foo]]" in replicating["indivisible"]  # not embed,
    # which following the advice refused: 4 is not divisible by 8


def test_a_rule_for_an_axis_of_other_models_is_harmless(replicating: dict[str, str]):
    assert replicating["harmless"] == "ok"  # as a dense Transformer's default `expert` rule


def test_nnx_train_on_a_mesh_its_default_rules_do_not_use_exits_2(tmp_path):
    result = cli(
        "nnx-train",
        str(ROOT / "configs" / "digits_vae.yaml"),
        "sharding.mesh={batch: 8}",
        "--workdir",
        "run",
        cwd=tmp_path,
        devices=8,
    )
    assert_user_error(result, "axis 'batch' has 8 devices", "sharding.rules=[[batch, batch]]")
    assert not (tmp_path / "run" / "checkpoints").exists()
