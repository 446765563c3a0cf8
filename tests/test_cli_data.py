"""Datasets for the trainer: scikit-learn digits, local files through `datasets`, batches by step."""

from __future__ import annotations

import numpy as np
import pytest

from nnx_cli.config import DataConfig
from nnx_cli.data import Batches, DataSpec, Split, eval_batches, known_spec, load_split, prefetch
from nnx_cli.errors import UserError


def image_dataset(n: int = 12, seed: int = 0):
    """A tiny `datasets.Dataset` of 6x5 greyscale PNG images with labels."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(n, 6, 5), dtype=np.uint8)
    ds = datasets.Dataset.from_dict({"img": [Image.fromarray(p) for p in pixels], "digit": [i % 3 for i in range(n)]})
    ds = ds.cast_column("img", datasets.Image()).cast_column("digit", datasets.ClassLabel(names=["a", "b", "c"]))
    return ds, pixels


def test_digits_has_train_and_test_splits_of_8x8_images():
    train = load_split(DataConfig(), "train")
    test = load_split(DataConfig(), "test")
    assert train.images.shape[1:] == (8, 8, 1) and len(train) + len(test) == 1797
    assert train.images.dtype == np.float32 and train.images.min() >= 0.0 and train.images.max() <= 1.0
    assert train.num_classes == 10


def test_digits_are_scikit_learns_digits_in_order():
    from sklearn.datasets import load_digits

    digits = load_digits()
    train, test = load_split(DataConfig(), "train"), load_split(DataConfig(), "test")
    np.testing.assert_array_equal(np.concatenate([train.images, test.images])[..., 0] * 16.0, digits.images)
    np.testing.assert_array_equal(np.concatenate([train.labels, test.labels]), digits.target)


def test_binarize_thresholds_pixels():
    split = load_split(DataConfig(binarize=0.5), "train")
    assert set(np.unique(split.images)) == {0.0, 1.0}


def test_local_parquet_file_is_decoded_into_arrays(tmp_path):
    ds, pixels = image_dataset()
    ds.to_parquet(str(tmp_path / "tiny.parquet"))
    split = load_split(DataConfig(source=str(tmp_path / "tiny.parquet"), image_key="img", label_key="digit"), "train")
    np.testing.assert_allclose(split.images[..., 0], pixels / 255.0, rtol=1e-6)
    assert split.labels.tolist() == [i % 3 for i in range(12)]
    assert split.num_classes == 3


def test_save_to_disk_directory_with_splits(tmp_path):
    import datasets

    train, pixels = image_dataset(seed=1)
    test, _ = image_dataset(n=4, seed=2)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(source=str(tmp_path / "saved"), image_key="img", label_key="digit")
    assert len(load_split(cfg, "test")) == 4
    np.testing.assert_allclose(load_split(cfg, "train").images[..., 0], pixels / 255.0, rtol=1e-6)


def test_save_to_disk_of_one_dataset_is_a_train_split_only(tmp_path):
    ds, _ = image_dataset(n=6)
    ds.save_to_disk(str(tmp_path / "one"))
    cfg = DataConfig(source=str(tmp_path / "one"), image_key="img", label_key="digit")
    assert len(load_split(cfg, "train")) == 6
    with pytest.raises(UserError, match="no split 'test'.*available: train.*data.eval_split=null"):
        load_split(cfg, "test", "data.eval_split")


def test_images_of_different_shapes_are_a_user_error(tmp_path):
    import datasets
    from PIL import Image

    images = [Image.fromarray(np.zeros((8 + i % 2, 8), np.uint8)) for i in range(4)]
    datasets.Dataset.from_dict({"img": images}).cast_column("img", datasets.Image()).to_parquet(
        str(tmp_path / "mixed.parquet")
    )
    with pytest.raises(UserError, match="come in 2 shapes"):
        load_split(DataConfig(source=str(tmp_path / "mixed.parquet"), image_key="img"), "train")


def test_directory_of_parquet_files_splits_by_file_name(tmp_path):
    train, _ = image_dataset(n=10)
    test, _ = image_dataset(n=3, seed=3)
    (tmp_path / "data").mkdir()
    train.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    cfg = DataConfig(source=str(tmp_path / "data"), image_key="img", label_key="digit")
    assert (len(load_split(cfg, "train")), len(load_split(cfg, "test"))) == (10, 3)


def test_missing_local_dataset_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="data.source.*does not exist"):
        load_split(DataConfig(source=str(tmp_path / "missing")), "train")


def test_unknown_split_lists_the_available_ones(tmp_path):
    ds, _ = image_dataset()
    ds.to_parquet(str(tmp_path / "tiny.parquet"))
    with pytest.raises(UserError, match="no split 'test'.*available: train"):
        load_split(DataConfig(source=str(tmp_path / "tiny.parquet"), image_key="img"), "test", "data.eval_split")


def test_unknown_image_column_suggests_closest(tmp_path):
    ds, _ = image_dataset()
    ds.to_parquet(str(tmp_path / "tiny.parquet"))
    with pytest.raises(UserError, match="data.image_key.*'imgs'.*did you mean 'img'"):
        load_split(DataConfig(source=str(tmp_path / "tiny.parquet"), image_key="imgs"), "train")


def test_known_datasets_have_shapes_without_reading():
    assert known_spec("ylecun/mnist") == DataSpec((28, 28, 1), 10)
    assert known_spec("sklearn:digits") == DataSpec((8, 8, 1), 10)
    assert known_spec("someone/unknown") is None


def split_of(n: int) -> Split:
    return Split(np.arange(n, dtype=np.float32)[:, None], np.arange(n, dtype=np.int32), None)


def test_batches_are_a_function_of_seed_and_step():
    a, b = Batches(split_of(50), 8, seed=3), Batches(split_of(50), 8, seed=3)
    for step in [0, 13, 5, 40, 13]:  # out of order, across epochs
        np.testing.assert_array_equal(a.get(step)["label"], b.get(step)["label"])
    assert not np.array_equal(a.get(0)["label"], Batches(split_of(50), 8, seed=4).get(0)["label"])


def test_each_epoch_visits_distinct_examples_and_drops_the_remainder():
    batches = Batches(split_of(50), 8, seed=0)
    assert batches.steps_per_epoch == 6
    seen = np.concatenate([batches.get(s)["label"] for s in range(6)])
    assert len(set(seen.tolist())) == 48
    assert not np.array_equal(batches.get(0)["label"], batches.get(6)["label"])


def test_batch_larger_than_the_split_is_a_user_error():
    with pytest.raises(UserError, match="train.batch_size"):
        Batches(split_of(5), 8, seed=0)


def test_eval_batches_cover_the_split_once_with_a_mask():
    batches = list(eval_batches(split_of(10), 4))
    assert [b["image"].shape[0] for b in batches] == [4, 4, 4]
    real = np.concatenate([b["label"][b["mask"]] for b in batches])
    assert real.tolist() == list(range(10))


def test_prefetch_yields_in_order_and_reraises_errors():
    assert list(prefetch(lambda s: s * 2, range(5))) == [0, 2, 4, 6, 8]

    def produce(step: int) -> int:
        if step == 2:
            raise RuntimeError("bad batch")
        return step

    with pytest.raises(RuntimeError, match="bad batch"):
        list(prefetch(produce, range(5)))
