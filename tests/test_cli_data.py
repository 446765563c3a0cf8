"""Where data comes from: scikit-learn's digits, local files and directories through `datasets`, known shapes."""

from __future__ import annotations

import numpy as np
import pytest
from image_support import png_dataset

from nnx_cli.config import DataConfig
from nnx_cli.data import DataSpec, known_spec
from nnx_cli.data.images import image_eval_split, image_train_split, load_images
from nnx_cli.errors import UserError


def image_dataset(n: int = 12, seed: int = 0):
    return png_dataset(n, seed=seed)


def local(tmp_path, source) -> DataConfig:
    return DataConfig(source=str(source), image_key="img", label_key="digit", cache_dir=str(tmp_path / "c"), workers=0)


def test_digits_has_train_and_test_splits_of_8x8_images():
    train, test = image_train_split(DataConfig(), 0), image_eval_split(DataConfig())
    assert train.spec == DataSpec((8, 8, 1), 10) and len(train) + len(test) == 1797


def test_digits_are_scikit_learns_digits_in_order():
    from sklearn.datasets import load_digits

    digits = load_digits()
    train, test = load_images(DataConfig(), "train"), load_images(DataConfig(), "test")
    np.testing.assert_array_equal(np.concatenate([train.image, test.image])[..., 0], digits.images)
    np.testing.assert_array_equal(np.concatenate([train.label, test.label]), digits.target)


def test_save_to_disk_directory_with_splits(tmp_path):
    import datasets

    train, pixels = image_dataset(seed=1)
    test, _ = image_dataset(n=4, seed=2)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    cfg = local(tmp_path, tmp_path / "saved")
    assert len(load_images(cfg, "test").image) == 4
    np.testing.assert_array_equal(load_images(cfg, "train").image[..., 0], pixels)


def test_a_saved_split_without_rows_is_named_rather_than_an_index_error(tmp_path):
    """`datasets` cannot load a save_to_disk split of no rows: "IndexError: list index out of range" was all."""
    import datasets

    train, _ = image_dataset(seed=1)
    datasets.DatasetDict({"train": train, "test": train.select([])}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(UserError, match=r"the split 'test' of '.*saved' holds no rows, and `datasets` cannot load"):
        load_images(local(tmp_path, tmp_path / "saved"), "train")


def test_save_to_disk_of_one_dataset_is_a_train_split_only(tmp_path):
    ds, _ = image_dataset(n=6)
    ds.save_to_disk(str(tmp_path / "one"))
    cfg = local(tmp_path, tmp_path / "one")
    assert len(load_images(cfg, "train").image) == 6
    with pytest.raises(UserError, match="no split 'test'.*available: train.*data.eval_split=null"):
        load_images(cfg, "test", "data.eval_split")


def test_directory_of_parquet_files_splits_by_file_name(tmp_path):
    train, _ = image_dataset(n=10)
    test, _ = image_dataset(n=3, seed=3)
    (tmp_path / "data").mkdir()
    train.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    cfg = local(tmp_path, tmp_path / "data")
    assert (len(load_images(cfg, "train").image), len(load_images(cfg, "test").image)) == (10, 3)


def test_known_datasets_have_shapes_without_reading():
    assert known_spec("ylecun/mnist") == DataSpec((28, 28, 1), 10)
    assert known_spec("sklearn:digits") == DataSpec((8, 8, 1), 10)
    assert known_spec("someone/unknown") is None


def test_prefetch_yields_in_order_and_reraises_errors():
    from nnx_cli.data.pipeline import prefetch

    assert list(prefetch(lambda s: s * 2, range(5))) == [0, 2, 4, 6, 8]

    def produce(step: int) -> int:
        if step == 2:
            raise RuntimeError("bad batch")
        return step

    with pytest.raises(RuntimeError, match="bad batch"):
        list(prefetch(produce, range(5)))
