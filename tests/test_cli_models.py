"""The model registry: logical axes on every parameter, options checked against the constructor."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

import nnx
from nnx_cli.config import ModelConfig
from nnx_cli.data import DataSpec
from nnx_cli.errors import UserError
from nnx_cli.models import REGISTRY, check_data, model_factory, resolve_options
from nnx_cli.registry import load_reference

DIGITS = DataSpec((8, 8, 1), 10)
TEXT = DataSpec((16,), 257, "bytes")
SPECS = {"transformer_lm": TEXT}  # the data each model reads; the others take images


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_parameter_of_a_registry_model_names_its_logical_axes(name: str):
    build = model_factory(ModelConfig(name=name), SPECS.get(name, DIGITS))
    params = jax.eval_shape(lambda: build(nnx.context(0)).filter(nnx.Param))
    assert params, name
    for path, param in params.items():
        assert param.sharding is not None and len(param.sharding) == param.value.ndim, (name, path, param.sharding)


def test_vae_kernels_use_embed_and_hidden():
    build = model_factory(ModelConfig(name="vae"), DIGITS)
    params = jax.eval_shape(lambda: build(nnx.context(0)).filter(nnx.Param))
    assert params["encoder/0/kernel"].sharding == ("embed", "hidden")
    assert params["decoder/1/kernel"].sharding == ("hidden", "embed")


def test_options_are_checked_against_the_constructors_annotations():
    with pytest.raises(UserError, match=r"config key 'model\.dropout' must be a number, got 'abc'"):
        resolve_options(ModelConfig(name="mlp_classifier", options={"dropout": "abc"}))
    with pytest.raises(UserError, match=r"config key 'model\.hidden_sizes\[1\]' must be an integer"):
        resolve_options(ModelConfig(name="vae", options={"hidden_sizes": [8, "wide"]}))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"latent_size": 0}, r"^config key 'model\.latent_size' must be positive, got 0"),
        ({"hidden_sizes": [16, 0]}, r"^config key 'model\.hidden_sizes' must hold positive sizes"),
    ],
)
def test_zero_sized_layers_are_a_user_error(options, message):
    build = model_factory(ModelConfig(name="vae", options=options), DIGITS)
    with pytest.raises(UserError, match=message):
        jax.eval_shape(lambda: build(nnx.context(0)).get_state())


def test_dropout_must_be_a_probability():
    build = model_factory(ModelConfig(name="mlp_classifier", options={"dropout": 1.5}), DIGITS)
    with pytest.raises(UserError, match=r"^config key 'model\.dropout' is a drop probability in \[0, 1\)"):
        jax.eval_shape(lambda: build(nnx.context(0)).get_state())


def test_a_configured_input_shape_must_match_the_data():
    with pytest.raises(
        UserError, match=r"'model\.input_shape' \[9, 9, 1\] does not match the data's inputs \[8, 8, 1\]"
    ):
        check_data(ModelConfig(name="vae", input_shape=[9, 9, 1]), REGISTRY["vae"], DIGITS, True, "label")


def test_a_classifier_needs_labels():
    with pytest.raises(UserError, match="needs labels.*no column 'digit'"):
        check_data(ModelConfig(name="cnn_classifier"), REGISTRY["cnn_classifier"], DIGITS, False, "digit")
    check_data(ModelConfig(name="vae"), REGISTRY["vae"], DIGITS, False, "digit")  # a VAE does not


def test_a_classifier_with_label_key_null_says_the_key_is_null():
    """It said the dataset had no column None."""
    with pytest.raises(UserError, match=r"^config key 'data.label_key' is null, and model 'cnn_classifier' needs"):
        check_data(ModelConfig(name="cnn_classifier"), REGISTRY["cnn_classifier"], DIGITS, False, None)


# --------------------------------------------------------------------------- package.module:attr references


def test_a_local_file_named_like_a_standard_module_is_named_as_the_one_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "json.py").write_text("def stripes(split):\n    return {}\n")
    with pytest.raises(
        UserError,
        match=r"'data\.source': module 'json' has no attribute 'stripes': the standard library's module 'json' "
        r"\(.*\) was imported instead of your json\.py, so rename json\.py",
    ):
        load_reference("json:stripes", "data.source")


def test_a_missing_attribute_of_a_local_module_is_named_without_a_rename_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "nnx_test_local_source", raising=False)
    (tmp_path / "nnx_test_local_source.py").write_text("def stripes(split):\n    return {}\n")
    with pytest.raises(UserError) as raised:
        load_reference("nnx_test_local_source:stipes", "data.source")
    assert str(raised.value) == "config key 'data.source': module 'nnx_test_local_source' has no attribute 'stipes'"
    sys.modules.pop("nnx_test_local_source", None)
